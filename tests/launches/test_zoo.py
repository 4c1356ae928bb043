"""The zoo's full tier (issue 37): families trained by the real `finetune train` on 2 CPU processes under ZeRO-2
and ZeRO-3, LoRA (on the experts too) and full, then converted, merged and chatted with, as a user would.

    python -m pytest -q -m full tests/launches/test_zoo.py     # 12-18 min on the shared 2-core box; never in the default run

Each run: the default recipe of the family's built-in model (recipes/tiny/base.yaml's data and steps), whose loss
falls; its last checkpoint converted (`finetune convert`) gives the adapter (or weights) the run saved; `finetune
merge` of an adapter equals peft's merge_and_unload; `finetune chat` answers. A mixture of experts logs its
router's auxiliary loss beside the loss.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import FINETUNE, REPO
from finetune.run.launch.commands import free_port
from tests.train_fixtures import TINY_RECIPES, runner_env

pytestmark = pytest.mark.full
STEPS = 6
# (built-in model, method, stage, extra --set): the zoo's distinguishing features under both ZeRO stages.
RUNS = [
    ("tiny-qwen3-moe", "lora", 3, ("lora.target_experts=true", "lora.target_router=true")),
    ("tiny-qwen3-moe", "full", 2, ()),
    ("tiny-mixtral", "lora", 2, ("lora.target_experts=true",)),
    ("tiny-gpt-oss", "lora", 3, ("model.attn_implementation=eager", "lora.target_experts=true")),
    ("tiny-qwen2-moe", "lora", 2, ()),
    ("tiny-gemma3", "lora", 3, ()),
    ("tiny-gemma2", "full", 3, ("model.attn_implementation=eager",)),
    ("tiny-phi3", "lora", 2, ()),
    ("tiny-qwen3", "full", 3, ()),
    ("tiny-olmo2", "lora", 3, ()),
]


def cli(*args, cache, timeout=900):
    return subprocess.run([*FINETUNE, *map(str, args)], cwd=REPO, env=runner_env(cache), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("name,method,stage,sets", RUNS, ids=[f"{r[0]}-{r[1]}-zero{r[2]}" for r in RUNS])
def test_family_trains_converts_merges_and_chats(name, method, stage, sets, tmp_path, tiny_cache):
    from safetensors.torch import load_file

    from finetune.builtin import ensure_builtin_model
    from tests.weights.merge_fixtures import assert_same, peft_merged_state_dict
    from tests.weights.test_merge import load_dir

    base = ensure_builtin_model(f"builtin:{name}", tiny_cache)
    run = tmp_path / "run"
    overrides = [f"model.name_or_path=builtin:{name}", f"method={method}", f"deepspeed.stage={stage}",
                 f"training.max_steps={STEPS}", f"training.save_steps={STEPS}", *sets]
    if method == "full":
        overrides.append("training.learning_rate=2.0e-3")
    args = [x for o in overrides for x in ("--set", o)]
    trained = cli("train", TINY_RECIPES / "base.yaml", "--output-dir", run, "--master-port", free_port(), *args,
                  cache=tiny_cache)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-5000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["train_loss_last"] < summary["train_loss_first"]
    if "moe" in name or name in ("tiny-mixtral", "tiny-gpt-oss"):
        assert summary["aux_loss_last"] is not None and "router aux loss" in trained.stdout
    saved = run / ("adapter" if method == "lora" else "model")
    converted = tmp_path / "converted"
    done = cli("convert", run / f"checkpoint-{STEPS}", "-o", converted, cache=tiny_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    if method == "lora":
        assert_same(load_file(str(converted / "adapter_model.safetensors")),
                    load_file(str(saved / "adapter_model.safetensors")))
        merged = tmp_path / "merged"
        done = cli("merge", run, "-o", merged, cache=tiny_cache)
        assert done.returncode == 0, done.stderr[-3000:]
        assert_same(load_dir(merged), peft_merged_state_dict(base, saved))
    else:
        assert_same(load_dir(converted), load_dir(saved))
    chat = cli("chat", run, "--prompt", "What is 2 plus 2?", "--max-new-tokens", 8, cache=tiny_cache)
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr[-3000:]
