"""The built-in tiny models: `model.name_or_path: builtin:tiny-llama` (or a zoo model, `builtin:tiny-qwen3-moe`).

A random-init Llama (4 layers, hidden 128, grouped-query attention) with a byte-level BPE tokenizer
trained on the demo instructions, built on first use under `~/.cache/finetune/models/` (the
`FINETUNE_CACHE` environment variable moves the root). It exists so that `finetune train
recipes/demo.yaml` runs anywhere, CPU included, without a download, and so that tests train a real
model through the real runner. It is also where the demo data comes from: `demo_examples()` writes
`recipes/data/demo_instructions.jsonl` (scripts/make_demo_data.py) and is the tokenizer's corpus,
so the model can be rebuilt from the package alone. The zoo (`ZOO`) adds one tiny model per family
users bring (Qwen2.5, Qwen3, Qwen3-MoE, Qwen2-MoE, Mistral, Mixtral, Gemma 2, Gemma 3, Phi-3/4, gpt-oss,
OLMo-2), each from its family's config class, with the same tokenizer.

    from finetune.builtin import resolve_model_path
    resolve_model_path("builtin:tiny-llama")  # -> '/root/.cache/finetune/models/tiny-llama-3f2a9c1e0b7d'

This module imports torch, transformers and tokenizers only inside the builders: the planner and the
linter may read `BUILTIN_CONFIGS` without them.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Iterator, Optional

from finetune.builtin_vision import VLM_SPECS
from finetune.data.cache_root import cache_root
from finetune.errors import FinetuneError
from finetune.fsutil import publish_once
# BUILTIN_PREFIX: everything else asks is_builtin() / builtin_name() (finetune.vision_models reads it without
# importing this module, which imports the data formats).
from finetune.recipe.references import BUILTIN_PREFIX, MODEL_CONFIG

# transformers LlamaConfig keyword arguments. 4 layers x hidden 128 with 768 tokens is ~0.8M
# parameters, a few milliseconds a step on a CPU. 4 query heads over 2 key/value heads, so
# grouped-query attention (k_proj/v_proj narrower than q_proj) is exercised as in Llama-3. Untied
# embeddings, like the 7B+ models the recipes target.
# initializer_range 0.08 (about 1/sqrt(hidden)), not Llama's 0.02: that std is meant for 4096-wide
# layers; here it would leave every logit within about +-2.6 of zero, and LoRA, which cannot change
# the frozen output head, would stall at a loss near 5.9. With 0.08 a fresh model starts near 7.1
# nats (ln 768 = 6.6, plus the spread of random logits) and LoRA brings the demo below 2.5.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(
        vocab_size=768, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.08,
    ),
}
# The zoo (issue 37): one tiny random model per family users bring, from the family's own config class
# (`model_type`), with what sets the family apart kept: grouped-query attention everywhere, q/k biases and
# tied embeddings (Qwen2.5), qk-norm and a head_dim that is not hidden / heads (Qwen3, Gemma 3, OLMo-2's
# full-width q/k norms), sliding windows of 16 tokens (Mistral, Gemma 2/3, gpt-oss) so the tests' longer
# rows cross them, soft-capping (Gemma 2), fused qkv and gate_up projections (Phi-3/Phi-4), attention sinks
# and biased routers and experts (gpt-oss), routers with 4 experts, 2 per token, and a shared expert with its
# sigmoid gate (Qwen2-MoE). Expert width 48: neither hidden (64) nor twice it, so an expert weight's
# orientation is never ambiguous. Every one builds in well under a second.
_ZOO_BASE = dict(vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08)
_MOE = dict(num_experts_per_tok=2)
ZOO: dict[str, dict[str, Any]] = {
    "tiny-qwen2.5": dict(_ZOO_BASE, model_type="qwen2", tie_word_embeddings=True),
    "tiny-qwen3": dict(_ZOO_BASE, model_type="qwen3", head_dim=32),
    "tiny-qwen3-moe": dict(_ZOO_BASE, **_MOE, model_type="qwen3_moe", head_dim=32, num_experts=4,
                           moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[]),
    "tiny-qwen2-moe": dict(_ZOO_BASE, **_MOE, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=48,
                           shared_expert_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[]),
    "tiny-mistral": dict(_ZOO_BASE, model_type="mistral", sliding_window=16),
    "tiny-mixtral": dict(_ZOO_BASE, **_MOE, model_type="mixtral", intermediate_size=48, num_local_experts=4),
    "tiny-gemma2": dict(_ZOO_BASE, model_type="gemma2", head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "tiny-gemma3": dict(_ZOO_BASE, model_type="gemma3_text", head_dim=32, sliding_window=16,
                        query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention"]),
    "tiny-phi3": dict(_ZOO_BASE, model_type="phi3"),
    "tiny-gpt-oss": dict(_ZOO_BASE, **_MOE, model_type="gpt_oss", head_dim=16, intermediate_size=48,
                         max_position_embeddings=131072,  # its YaRN default stretches 4,096 positions 32 times
                         num_local_experts=4, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "tiny-olmo2": dict(_ZOO_BASE, model_type="olmo2"),
}
BUILTIN_CONFIGS.update(ZOO)
DEFAULT_MODEL_TYPE = "llama"  # tiny-llama's config predates the zoo and names no model_type
MODEL_SEED = 0
# Bump when the builder or the demo data changes in a way the config does not show: it is part of
# the cache directory's name, so old builds are never reused by mistake.
BUILD_VERSION = 1

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# One turn: `<|role|>` newline content `</s>`. The assistant's turn ends with EOS so the model learns
# to stop; the generation prompt is the assistant header.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class BuiltinModelError(FinetuneError, ValueError):
    """An unknown `builtin:` name."""


def is_builtin(name_or_path: str) -> bool:
    return name_or_path.startswith(BUILTIN_PREFIX)


def builtin_names() -> list[str]:
    """Every built-in model's name: the tiny Llama, and the tiny vision-language models (finetune.builtin_vision)."""
    return [*BUILTIN_CONFIGS, *VLM_SPECS]


def builtin_name(name_or_path: str) -> str:
    """'builtin:tiny-llama' -> 'tiny-llama' (raises BuiltinModelError for an unknown name)."""
    name = name_or_path[len(BUILTIN_PREFIX):] if is_builtin(name_or_path) else name_or_path
    if name not in builtin_names():
        known = ", ".join(BUILTIN_PREFIX + n for n in builtin_names())
        raise BuiltinModelError(f"unknown built-in model `{BUILTIN_PREFIX}{name}` (known: {known})")
    return name


def builtin_config(name_or_path: str) -> dict[str, Any]:
    """A built-in model's config.json as a dict, model_type included (for the planner and lint; no torch); a
    built-in vision-language model's as finetune.builtin_vision gives it."""
    name = builtin_name(name_or_path)
    if name in VLM_SPECS:
        return dict(VLM_SPECS[name]["config"])
    return {"model_type": DEFAULT_MODEL_TYPE, **BUILTIN_CONFIGS[name]}


def resolve_model_path(name_or_path: str) -> str:
    """A hub id or local path unchanged; `builtin:NAME` -> the local directory (built on first use)."""
    if not is_builtin(name_or_path):
        return name_or_path
    return str(ensure_builtin_model(name_or_path))


def builtin_model_dir(name_or_path: str, root: Optional[Path] = None) -> Path:
    """Where a built-in model lives (under `root`, default cache_root()); the name hashes what shapes it."""
    name = builtin_name(name_or_path)
    spec = {"config": BUILTIN_CONFIGS[name], "seed": MODEL_SEED, "version": BUILD_VERSION,
            "chat_template": CHAT_TEMPLATE, "data": DEMO_DATA_VERSION} if name in BUILTIN_CONFIGS else \
        {"vlm": VLM_SPECS[name], "version": BUILD_VERSION}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return (Path(root) if root is not None else cache_root()) / "models" / f"{name}-{digest}"


def ensure_builtin_model(name_or_path: str, root: Optional[Path] = None) -> Path:
    """Build the model and tokenizer once (temp dir + rename); later calls return the directory.

    Safe when two processes race: each builds in its own temporary directory, the first rename
    wins, and the loser discards its copy (both builds are identical: fixed seed, fixed corpus).
    """
    target = builtin_model_dir(name_or_path, root)
    if (target / MODEL_CONFIG).is_file():
        return target
    # 0o755: the cache may be shared by the users of the box
    with publish_once(target, MODEL_CONFIG, mode=0o755) as tmp:
        _build(builtin_name(name_or_path), tmp)
    return target


def _build(name: str, out: Path) -> None:
    if name in VLM_SPECS:
        from finetune.builtin_vision import build

        build(name, out)
        return
    build_tokenizer(out)
    _build_model(name, out)


def _build_model(name: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    kwargs = builtin_config(name)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    # fork_rng: building the model must not move the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out))


def build_tokenizer(out: Path, vocab_size: int = BUILTIN_CONFIGS["tiny-llama"]["vocab_size"]) -> None:
    """Byte-level BPE trained on the demo data; saved as a PreTrainedTokenizerFast with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, *ROLE_TOKENS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Every encoded text starts with BOS, like Llama's tokenizer; trim_offsets=False keeps the
    # character offsets exact (the data module uses them to find the assistant's spans).
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=list(ROLE_TOKENS), model_max_length=512)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _tokenizer_corpus() -> Iterator[str]:
    from finetune.data.formats import RowSpec, alpaca

    for example in demo_examples():
        prompted = alpaca(example, RowSpec())
        yield prompted.prompt + prompted.response


# ------------------------------------------------------------------------------------------------
# The demo instructions: short alpaca-format tasks a 0.8M-parameter model can visibly learn (fixed
# answer formats, facts repeated across phrasings). Deterministic: same list on every machine.

DEMO_DATA_VERSION = 1
DEMO_SEED = 1234

_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Canada": "Ottawa", "Mexico": "Mexico City",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Australia": "Canberra", "Russia": "Moscow", "Norway": "Oslo", "Sweden": "Stockholm",
    "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Peru": "Lima", "Chile": "Santiago",
    "Ireland": "Dublin",
}
_UNITS = [("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
          ("hours", "minutes", 60), ("minutes", "seconds", 60), ("liters", "milliliters", 1000),
          ("days", "hours", 24), ("weeks", "days", 7)]
_WORDS = ["red", "green", "blue", "cat", "dog", "bird", "sun", "moon", "star", "tree", "river",
          "stone", "apple", "bread", "milk", "book", "door", "cloud", "rain", "snow"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
                 "eighteen", "nineteen", "twenty"]


def demo_examples() -> list[dict[str, str]]:
    """About 320 alpaca examples ({instruction, input, output}) in a fixed shuffled order."""
    rng = random.Random(DEMO_SEED)
    examples = (_arithmetic(rng, 80) + _capitals(rng) + _conversions(rng, 64) + _reversals(rng, 64)
                + _number_words(rng, 40))
    rng.shuffle(examples)
    return examples


def _example(instruction: str, output: str, input: str = "") -> dict[str, str]:
    return {"instruction": instruction, "input": input, "output": output}


def _arithmetic(rng: random.Random, count: int) -> list[dict[str, str]]:
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if rng.random() < 0.5:
            out.append(_example(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
        else:
            a, b = max(a, b), min(a, b)
            out.append(_example(f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."))
    return out


def _capitals(rng: random.Random) -> list[dict[str, str]]:
    out = []
    for country, capital in _CAPITALS.items():
        out.append(_example(f"What is the capital of {country}?", f"The capital of {country} is {capital}."))
        out.append(_example("Name the capital city of this country.", f"The capital of {country} is {capital}.", country))
        if rng.random() < 0.5:
            out.append(_example(f"Which country has {capital} as its capital?", f"{capital} is the capital of {country}."))
    return out


def _conversions(rng: random.Random, count: int) -> list[dict[str, str]]:
    out = []
    for _ in range(count):
        big, small, factor = rng.choice(_UNITS)
        n = rng.randint(1, 9)
        out.append(_example(f"Convert {n} {big} to {small}.", f"{n} {big} is {n * factor} {small}."))
    return out


def _reversals(rng: random.Random, count: int) -> list[dict[str, str]]:
    out = []
    for _ in range(count):
        words = rng.sample(_WORDS, rng.randint(2, 4))
        out.append(_example("Reverse the order of these words.", " ".join(reversed(words)), " ".join(words)))
    return out


def _number_words(rng: random.Random, count: int) -> list[dict[str, str]]:
    out = []
    for _ in range(count):
        n = rng.randint(0, 20)
        out.append(_example(f"Write the number {n} in words.", f"{n} in words is {_NUMBER_WORDS[n]}."))
    return out


def write_demo_jsonl(path: Path) -> int:
    """Write demo_examples() as JSON lines (the shipped recipes/data/demo_instructions.jsonl)."""
    from finetune.fsutil import write_atomic

    examples = demo_examples()
    write_atomic(Path(path), "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples))
    return len(examples)


# ShareGPT chats for the mixing recipe (recipes/tiny/mix_alpaca_sharegpt.yaml): two demo questions
# per conversation, in the demo's own words (the tiny tokenizer knows no others), the second turn's
# answer sometimes switched out of the loss to exercise the per-message flag.
DEMO_CHATS_SEED = 4321
DEMO_CHATS = 80


def demo_conversations() -> list[dict[str, Any]]:
    rng = random.Random(DEMO_CHATS_SEED)
    examples = demo_examples()
    chats = []
    for _ in range(DEMO_CHATS):
        first, second = rng.sample(examples, 2)
        turns = []
        for example in (first, second):
            question = f"{example['instruction']} {example['input']}".strip()
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": example["output"]}]
        if rng.random() < 0.25:
            turns[1]["train"] = False
        chats.append({"conversations": turns})
    return chats


def write_demo_sharegpt(path: Path) -> int:
    """Write demo_conversations() as JSON lines (the shipped recipes/data/demo_chats_sharegpt.jsonl)."""
    from finetune.fsutil import write_atomic

    chats = demo_conversations()
    write_atomic(Path(path), "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in chats))
    return len(chats)
