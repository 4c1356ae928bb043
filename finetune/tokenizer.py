"""The recipe's tokenizer: the model's own (or `model.tokenizer`), with a pad token and the recipe's chat template.

Loaded by the launcher before tokenizing (finetune.run.start), by each rank (finetune.train.runner) and by
`finetune data show`: one definition, so the cache key they compute is the same.
"""

from __future__ import annotations

from finetune.builtin import resolve_model_path
from finetune.recipe import Recipe


def load_tokenizer(recipe: Recipe, model_path: str):
    """The model's tokenizer (or `model.tokenizer`), with a pad token and the recipe's chat template."""
    from transformers import AutoTokenizer

    m = recipe.model
    source = resolve_model_path(m.tokenizer) if m.tokenizer else model_path
    revision = m.revision if not m.tokenizer else None
    tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=m.trust_remote_code)
    if recipe.data.chat_template:
        tokenizer.chat_template = recipe.data.chat_template
    if tokenizer.pad_token_id is None:
        # Llama-3 and others ship no pad token. Adding one would grow the embedding matrix (and, with
        # LoRA, need embed_tokens trained and saved); padding with EOS is safe because padded
        # positions are masked out of attention and of the loss.
        tokenizer.pad_token = tokenizer.eos_token
    chat = [f for f in recipe.data.source_formats() if f in ("messages", "sharegpt")]
    if chat and not tokenizer.chat_template:
        from finetune.data.tokenize import DataError

        raise DataError(f"{source}: the tokenizer has no chat template; set data.chat_template for format: {chat[0]}")
    return tokenizer
