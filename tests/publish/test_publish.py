"""`finetune publish`: the model card, what is sent, and a round trip through a local stand-in of the Hub
(tests/publish/hub_standin.py, 127.0.0.1; the real Hub is never contacted) that keeps every byte it receives."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.publish.hub_standin import HubStandIn

TOKEN = "hf_standin0token0never0published"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in, with huggingface_hub pointed at it, Xet off (its protocol is not stood in), a token."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with HubStandIn() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


@pytest.fixture(scope="module")
def hub_base_run(tiny_dir, tmp_path_factory):
    """A demo run whose base is a Hub id (org/tiny-base) and whose data is a Hub data set, with a random adapter
    whose adapter_config names the local folder it was made from, and the numbers a finished run has."""
    import torch
    from peft import LoraConfig, get_peft_model
    from ruamel.yaml import YAML
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.train_fixtures import write_run_dir

    run_dir = tmp_path_factory.mktemp("publish") / "run"
    write_run_dir(REPO / "recipes" / "demo.yaml", run_dir, overrides=("lora.rslora=true",))
    yaml = YAML(typ="safe", pure=True)
    recipe = yaml.load((run_dir / "recipe.yaml").read_text())
    recipe["model"]["name_or_path"] = "org/tiny-base"
    recipe["data"]["path"] = "org/demo-data"
    recipe["training"]["report_to"] = ["wandb"]
    with open(run_dir / "recipe.yaml", "w") as handle:
        yaml.dump(recipe, handle)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", use_rslora=True, init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(str(run_dir / "adapter"))
    assert str(tiny_dir) in (run_dir / "adapter" / "adapter_config.json").read_text()  # PEFT wrote the local path
    AutoTokenizer.from_pretrained(str(tiny_dir)).save_pretrained(str(run_dir / "tokenizer"))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 117, "train_loss_first": 7.15, "train_loss_last": 2.4,
                                                      "tokens_trained": 25117, "wall_seconds": 69, "world_size": 2,
                                                      "zero_stage": 3, "output": str(run_dir / "adapter")}))
    (run_dir / "eval.json").write_text(json.dumps({
        "data": f"the training data ({run_dir}/data.jsonl)", "held_out": False, "sequences": 307,
        "base": {"loss": 7.11, "perplexity": 1227.5, "tokens": 2060}, "tuned": {"loss": 2.29, "perplexity": 9.85, "tokens": 2060},
        "benchmarks": {"lm_eval": "0.4.13", "prompt": "alpaca", "seconds": 1.0, "tasks": {"demo_qa": {
            "file": "demo_qa.yaml", "samples": 40, "metrics": {"acc": {"base": 0.3, "fine_tuned": 0.8}}}}}}))
    (run_dir / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "logs" / "rank0.log").write_text(f"HF_TOKEN={TOKEN}\n")  # never published
    return run_dir


def _cached_base_card(tmp_path: Path, monkeypatch) -> None:
    """org/tiny-base's model card in a Hugging Face cache, as a download of it leaves one (the licence's source)."""
    from huggingface_hub import constants

    repo = tmp_path / "hub-cache" / "models--org--tiny-base"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40) / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny base\n")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def test_publish_round_trip_sends_no_local_path_or_token(hub_base_run, hub, tmp_path, monkeypatch):
    from huggingface_hub import snapshot_download

    from finetune.publish.upload import publish

    _cached_base_card(tmp_path, monkeypatch)
    result = publish(hub_base_run, "me/demo-lora", private=True)
    assert result.url and "me/demo-lora/commit/" in result.url
    sent = {item.path: item.data() for item in result.publication.items}
    assert sorted(sent) == sorted(["adapter_model.safetensors", "adapter_config.json", "tokenizer.json",
                                   "tokenizer_config.json", "chat_template.jinja", "trained_chat_template.jinja",
                                   "loss.png", "finetune_recipe.yaml", "finetune_format.json", "README.md"])
    assert hub.repos["me/demo-lora"].private
    assert {"adapter_model.safetensors", "loss.png"} <= hub.repos["me/demo-lora"].lfs_paths  # both upload kinds ran

    # Every byte that left: no local path, no token (the token went in the Authorization header only).
    uploaded = hub.uploaded_bytes()
    for local in {str(hub_base_run), str(REPO), os.path.expanduser("~"), os.getcwd(), sys.prefix, str(tmp_path)}:
        assert local.encode() not in uploaded, local
    assert TOKEN.encode() not in uploaded
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests if r.method == "POST")

    # The round trip returns the same bytes.
    folder = snapshot_download("me/demo-lora", endpoint=hub.endpoint, cache_dir=str(tmp_path / "download"),
                               token=TOKEN)
    got = {p.name: p.read_bytes() for p in Path(folder).iterdir()}
    assert got == sent

    config = json.loads(sent["adapter_config.json"])
    assert config["base_model_name_or_path"] == "org/tiny-base" and config["lora_alpha"] == 32  # not 32.0
    assert config["use_rslora"] is True  # PEFT's own loader reads it: no llama.cpp rescaling here
    card = sent["README.md"].decode()
    meta = card.split("---")[1]
    for line in ("base_model: org/tiny-base", "base_model_relation: adapter", "library_name: peft",
                 "license: apache-2.0", "- org/demo-data", "type: acc", "value: 0.8"):
        assert line in meta, line
    assert "### Instruction:\n{instruction}\n\n### Response:" in card  # the exact prompt
    assert "vllm serve org/tiny-base --enable-lora --lora-modules demo=me/demo-lora --max-lora-rank 16" in card
    assert "SGLang: merge first" in card  # rsLoRA: SGLang scales by alpha / r
    assert "![train loss and learning rate](loss.png)" in card and "| steps | 117 |" in card
    recipe = sent["finetune_recipe.yaml"].decode()
    assert "path: org/demo-data" in recipe and "name_or_path: org/tiny-base" in recipe


def test_dry_run_lists_every_file_and_the_card_without_a_token(hub_base_run, monkeypatch, tmp_path):
    from huggingface_hub import constants
    from typer.testing import CliRunner

    from finetune.cli import app

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail the command
    dry = CliRunner().invoke(app, ["publish", str(hub_base_run), "--repo", "me/demo-lora", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "would upload to me/demo-lora (adapter, 10 files" in dry.stdout
    assert "adapter_model.safetensors" in dry.stdout and "--- README.md (the model card) ---" in dry.stdout
    refused = CliRunner().invoke(app, ["publish", str(hub_base_run), "--repo", "me/demo-lora"])
    assert refused.exit_code == 1 and refused.stderr.strip() == "error: " + __import__(
        "finetune.publish.upload", fromlist=["NO_TOKEN"]).NO_TOKEN
    bad = CliRunner().invoke(app, ["publish", str(hub_base_run), "--repo", "no-slash", "--dry-run"])
    assert bad.exit_code == 2 and "expected USER/NAME" in bad.stderr


def test_a_gguf_export_and_a_merged_model_get_their_own_cards(tiny_dir, tmp_path):
    import shutil

    from finetune.publish.upload import publish

    export = tmp_path / "export"
    export.mkdir()
    (export / "demo-q8_0.gguf").write_bytes(b"GGUF" + bytes(64))
    (export / "Modelfile").write_text("FROM ./demo-q8_0.gguf\n")
    (export / "export.json").write_text(json.dumps({"source": "demo", "type": "q8_0", "gguf": "demo-q8_0.gguf",
                                                    "prompt": "alpaca", "stops": ["</s>"], "base_model": "org/tiny-base"}))
    result = publish(export, "me/demo-gguf", dry_run=True)
    assert [i.path for i in result.publication.items] == ["demo-q8_0.gguf", "export.json", "Modelfile", "README.md"]
    assert "library_name: gguf" in result.card and "base_model_relation: finetune" in result.card
    assert "llama-server -hf me/demo-gguf" in result.card and "ollama create demo -f Modelfile" in result.card

    merged = tmp_path / "merged"
    shutil.copytree(tiny_dir, merged)
    (merged / "stray.log").write_text("not a model file")
    result = publish(merged, "me/merged", dry_run=True)
    assert "stray.log" not in [i.path for i in result.publication.items]
    assert "vllm serve me/merged" in result.card and "library_name: transformers" in result.card
    assert "base_model_relation" not in result.card  # no recipe: its base is not known


def test_recipe_scrub_keeps_hub_ids_and_drops_paths_and_secrets():
    from finetune.publish.scrub import REDACTED, scrub

    out = scrub({"model": {"name_or_path": "/home/me/models/base", "tokenizer": "org/tok"},
                 "data": {"path": "/data/train.jsonl", "sources": [{"path": "org/set"}]},
                 "hub_token": "hf_x", "wandb": {"api_key": "k"}, "output_dir": "~/runs/x"})
    assert out == {"model": {"name_or_path": "base", "tokenizer": "org/tok"},
                   "data": {"path": "train.jsonl", "sources": [{"path": "org/set"}]},
                   "hub_token": REDACTED, "wandb": {"api_key": REDACTED}, "output_dir": "x"}
