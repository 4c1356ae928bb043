"""Helpers for the training tests: a run directory written as `finetune train` writes it, the real
runner under torchrun (2 CPU processes), and reloading the saved artifacts in this process.

    run_dir = write_run_dir(REPO / "recipes/tiny/lora_zero3.yaml", tmp_path / "run")
    result = launch_runner(run_dir, procs=2, cache=cache)
    expected, reloaded, untrained = reload_logits(run_dir)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
TINY_RECIPES = REPO / "recipes" / "tiny"


def cache_dir(tmp_path_factory) -> Path:
    """One FINETUNE_CACHE per pytest session: the tiny model and tokenized data are built once."""
    return tmp_path_factory.getbasetemp() / "finetune-cache"


def write_run_dir(recipe_path: Path, run_dir: Path, world_size: int = 2, overrides: tuple[str, ...] = ()):
    """recipe.yaml, deepspeed.json and training_args.json, the inputs the launcher writes. Returns the recipe."""
    from ruamel.yaml import YAML

    from finetune.render import dumps, render_deepspeed, render_training_args
    from finetune.recipe import load_recipe

    recipe = load_recipe(recipe_path, list(overrides)).recipe
    for block in [recipe.data, *(recipe.data.sources or [])]:  # the launcher writes absolute paths
        if block.path:
            block.path = str(Path(block.path).resolve())
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    from finetune.recipe.auto import with_auto

    with open(run_dir / "recipe.yaml", "w", encoding="utf-8") as handle:  # `auto` kept, as finetune.rundir.layout writes it
        yaml.dump(with_auto(recipe.model_dump(mode="json"), recipe.auto_keys), handle)
    (run_dir / "deepspeed.json").write_text(dumps(render_deepspeed(recipe, world_size)))
    (run_dir / "training_args.json").write_text(dumps(render_training_args(recipe, output_dir=str(run_dir))))
    return recipe


def runner_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"FINETUNE_CACHE": str(cache), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def launch_runner(run_dir: Path, cache: Path, procs: int = 2, timeout: float = 300,
                  extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`torchrun --standalone` (a free port of its own) running the real runner module, after the step
    `finetune train` runs before launching: the training set tokenized into `cache` (its lines come first in
    stdout, as on `finetune train`'s console)."""
    prepared = prepare_data(run_dir, cache)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
            "-m", "finetune.train.runner", "--run-dir", str(run_dir), *extra]
    result = subprocess.run(argv, cwd=REPO, env=runner_env(cache), capture_output=True, text=True, timeout=timeout)
    result.stdout = "".join(f"[finetune] {line}\n" for line in prepared) + result.stdout
    return result


def prepare_data(run_dir: Path, cache: Path) -> list[str]:
    """What `finetune train` does in the launcher: tokenize the run's training set into `cache`; its lines."""
    from finetune.data.prepare_recipe import prepare_recipe
    from finetune.objectives import get as objective_record
    from finetune.recipe import load_recipe
    from finetune.tokenizer import load_for_launch

    before = os.environ.get("FINETUNE_CACHE")
    os.environ["FINETUNE_CACHE"] = str(cache)
    lines: list[str] = []
    try:
        recipe = load_recipe(Path(run_dir) / "recipe.yaml").recipe
        if not objective_record(recipe.objective).uses_trl:  # TRL's trainers tokenize their own rows
            prepare_recipe(recipe, load_for_launch(recipe), log=lines.append)
    finally:
        if before is None:
            os.environ.pop("FINETUNE_CACHE")
        else:
            os.environ["FINETUNE_CACHE"] = before
    return lines


def load_trained(run_dir: Path):
    """The trained model rebuilt from the run directory's adapter/ or model/ alone (eval mode)."""
    import json

    from transformers import AutoModelForCausalLM

    from finetune.train.model import quantization_config, torch_dtype
    from finetune.train.runner import read_run_dir

    recipe, _, _ = read_run_dir(run_dir)
    dtype = torch_dtype(recipe.model.dtype)
    if (run_dir / "model").is_dir():
        return AutoModelForCausalLM.from_pretrained(str(run_dir / "model"), dtype=dtype).eval()
    from peft import PeftModel

    base_path = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    kwargs = {"dtype": dtype}
    quant = quantization_config(recipe)
    if quant is not None:
        kwargs["quantization_config"] = quant
    base = AutoModelForCausalLM.from_pretrained(base_path, **kwargs)
    return PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()


def reload_logits(run_dir: Path, base: Optional[Path] = None):
    """(logits saved by the runner, logits of the reloaded artifacts, logits of the untrained base)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(str(run_dir / "final_logits.safetensors"))
    inputs = {k: v for k, v in saved.items() if k != "logits"}
    model = load_trained(run_dir)
    with torch.no_grad():
        reloaded = model(**inputs, use_cache=False).logits.float()
        if hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                untrained = model(**inputs, use_cache=False).logits.float()
        else:
            untrained = AutoModelForCausalLM.from_pretrained(str(base), dtype=model.dtype).eval()(**inputs, use_cache=False).logits.float()
    return saved["logits"], reloaded, untrained


def assert_run_report(run_dir: Path, steps: int) -> None:
    """loss.png is a PNG, report.html parses and embeds that very PNG, and the history covers steps 1..N."""
    import base64
    import json
    from html.parser import HTMLParser

    png = (run_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:16]

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.images, self.headings, self.text, self._in = [], [], [], None

        def handle_starttag(self, tag, attrs):
            self._in = tag
            if tag == "img":
                self.images.append(dict(attrs)["src"])

        def handle_data(self, data):
            self.text.append(data)
            if self._in == "h2":
                self.headings.append(data)

    page = Page()
    page.feed((run_dir / "report.html").read_text(encoding="utf-8"))
    page.close()
    assert {"Summary", "Loss and learning rate", "Memory per rank: plan vs measured", "Next", "Versions",
            "Speed: the steady state, after the warm-up steps"} <= set(page.headings)
    (image,) = page.images
    assert base64.b64decode(image.split(",", 1)[1]) == png
    text = "".join(page.text)
    assert f"finetune chat {run_dir}" in text and '"zero_optimization"' in text
    history = json.loads((run_dir / "summary.json").read_text())["loss_history"]
    assert [e["step"] for e in history] == list(range(1, steps + 1))


def trains_the_same(model, one: dict, other: dict) -> None:
    """The two batches give the model the same loss and the same gradient on every parameter."""
    import torch

    results = []
    for batch in (one, other):
        model.zero_grad()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    model.zero_grad()
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    assert len(results[0][1]) == len(results[1][1])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
