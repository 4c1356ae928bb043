"""The recipe's tokenizer: the model's own (or `model.tokenizer`), with a pad token and the recipe's chat template.

Loaded by the launcher before tokenizing (finetune.run.start), by each rank (finetune.train.runner) and by
`finetune data show`: one definition, so the cache key they compute is the same.

`AutoTokenizer` imports torch (transformers' config classes do: about 280 MB of resident memory), which the
tokenizer itself does not need. `load_without_torch` therefore resolves it in a short-lived child process
(`python -m finetune.tokenizer`) and receives it pickled, the way datasets already ships it to its map workers:
the same object, and the process that tokenizes (and every worker it forks) stays free of torch.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from finetune.builtin import resolve_model_path
from finetune.recipe import Recipe

_OK = b"FINETUNE-TOKENIZER\n"  # what starts the child's stdout before the pickle


def tokenizer_args(recipe: Recipe, model_path: str) -> dict[str, Any]:
    """What `from_args` needs, as plain values (they travel to the child process as JSON)."""
    m = recipe.model
    return {"source": resolve_model_path(m.tokenizer) if m.tokenizer else model_path,
            "revision": m.revision if not m.tokenizer else None, "trust_remote_code": bool(m.trust_remote_code),
            "chat_template": recipe.data.chat_template,
            "chat_formats": [f for f in recipe.data.source_formats() if f in ("messages", "sharegpt")]}


def load_for_launch(recipe: Recipe):
    """The recipe's tokenizer as `finetune train`'s launcher and `finetune prepare` load it: a built-in model built
    first, torch not imported (load_without_torch)."""
    return load_without_torch(tokenizer_args(recipe, resolve_model_path(recipe.model.name_or_path)))


def load_tokenizer(recipe: Recipe, model_path: str):
    """The model's tokenizer (or `model.tokenizer`), with a pad token and the recipe's chat template."""
    return from_args(**tokenizer_args(recipe, model_path))


def from_args(source: str, revision: Optional[str] = None, trust_remote_code: bool = False,
              chat_template: Optional[str] = None, chat_formats: Optional[list[str]] = None):
    from transformers import AutoTokenizer

    from finetune.fsutil import refuse_special

    refuse_special(source)  # a FIFO among its files would hang from_pretrained
    tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    if chat_template:
        tokenizer.chat_template = chat_template
    if tokenizer.pad_token_id is None:
        # Llama-3 and others ship no pad token. Adding one would grow the embedding matrix (and, with
        # LoRA, need embed_tokens trained and saved); padding with EOS is safe because padded
        # positions are masked out of attention and of the loss.
        tokenizer.pad_token = tokenizer.eos_token
    if chat_formats and not tokenizer.chat_template:
        from finetune.data.tokenize import DataError

        raise DataError(f"{source}: the tokenizer has no chat template; set data.chat_template for format: {chat_formats[0]}")
    return tokenizer


def load_without_torch(args: dict[str, Any]):
    """`from_args(**args)` without importing torch here: loaded in a child process and unpickled (in this
    process when torch is already imported: nothing to save). Raises DataError (no chat template) or OSError
    (cannot load it) with the child's one-line reason."""
    if "torch" in sys.modules:
        return from_args(**args)
    import finetune

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(finetune.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-m", "finetune.tokenizer"], input=json.dumps(args).encode(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    if done.stderr:
        sys.stderr.write(done.stderr.decode(errors="replace"))  # transformers' warnings, as if loaded here
    if done.returncode == 0 and done.stdout.startswith(_OK):
        try:
            return pickle.loads(done.stdout[len(_OK):])
        except Exception:  # noqa: BLE001 - a class this process cannot import (remote code): load it here
            return from_args(**args)
    try:
        kind, message = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        kind, message = "os", f"{args['source']}: cannot load the tokenizer: {done.stderr.decode().strip()[-2000:]}"
    if kind == "data":
        from finetune.data.tokenize import DataError

        raise DataError(message)
    raise OSError(message)


def _child() -> int:
    """`python -m finetune.tokenizer`: the tokenizer of the JSON arguments on stdin, pickled to stdout."""
    args = json.loads(sys.stdin.read())
    out, sys.stdout = sys.stdout.buffer, sys.stderr  # whatever a library prints goes to stderr, not into the pickle
    from finetune.data.tokenize import DataError

    try:
        tokenizer = from_args(**args)
    except DataError as exc:
        out.write(json.dumps(["data", str(exc)]).encode())
        return 1
    except Exception as exc:  # noqa: BLE001 - transformers and the hub raise many types; the parent says it
        out.write(json.dumps(["os", f"{args['source']}: cannot load the tokenizer: {exc}"]).encode())
        return 1
    out.write(_OK + pickle.dumps(tokenizer))
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_child())
