"""The built-in tiny model: `builtin:tiny-llama` is built once, atomically, the same everywhere."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.builtin import (
    BUILTIN_CONFIGS, BuiltinModelError, builtin_config, builtin_model_dir, ensure_builtin_model, resolve_model_path,
)
from tests.train_fixtures import REPO


def test_hub_ids_and_paths_pass_through():
    assert resolve_model_path("meta-llama/Meta-Llama-3-8B") == "meta-llama/Meta-Llama-3-8B"
    assert resolve_model_path("/models/llama") == "/models/llama"


def test_unknown_builtin_names_the_known_ones():
    with pytest.raises(BuiltinModelError, match=r"unknown built-in model `builtin:tiny-gpt` \(known: builtin:tiny-llama, "
                                                r"builtin:tiny-qwen2.5, .*builtin:tiny-olmo2, builtin:tiny-qwen2.5-vl, builtin:tiny-llava\)"):
        resolve_model_path("builtin:tiny-gpt")


def test_resolve_uses_finetune_cache(tmp_path, monkeypatch, tiny_dir):
    monkeypatch.setenv("FINETUNE_CACHE", str(tiny_dir.parent.parent))
    assert resolve_model_path("builtin:tiny-llama") == str(tiny_dir)
    assert builtin_model_dir("builtin:tiny-llama") == tiny_dir


def test_built_model_matches_the_declared_config(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    for key, value in builtin_config("builtin:tiny-llama").items():
        assert config[key] == value, key
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention


def test_tokenizer_has_specials_and_a_chat_template(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert len(tok) <= BUILTIN_CONFIGS["tiny-llama"]["vocab_size"]
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|user|>\nHi</s><|assistant|>\n"
    # The corpus it was trained on makes the demo prompts short.
    assert len(tok("### Instruction:\nWhat is the capital of France?\n\n### Response:\n")["input_ids"]) < 20


def test_second_call_reuses_the_directory(tiny_dir):
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin_model("builtin:tiny-llama", tiny_dir.parent.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_racing_builders_agree_and_leave_one_identical_copy(tmp_path, tiny_dir):
    """Two processes build into an empty cache at once (two ranks, or preflight and a rank)."""
    code = "import sys; from finetune.builtin import ensure_builtin_model; print(ensure_builtin_model('builtin:tiny-llama', sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outputs]
    paths = {o[0].strip().splitlines()[-1] for o in outputs}
    assert len(paths) == 1
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir()] == [tiny_dir.name]  # no temporary leftovers
    # Same weights and tokenizer as the session's build in another directory: fixed seed, fixed corpus.
    built = models / tiny_dir.name
    assert (built / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    assert (built / "tokenizer.json").read_text() == (tiny_dir / "tokenizer.json").read_text()


def test_importing_tiny_stays_light():
    code = "import sys, finetune.builtin; print(any(m in sys.modules for m in ('torch', 'transformers', 'tokenizers')))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
