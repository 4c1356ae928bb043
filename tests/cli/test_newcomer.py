"""Issue 24, a newcomer's first hour: every printed command runs as typed, the README set-up runs twice,
errors name the fix, and no minute passes in silence. CLI output is captured from the real entry point."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FINETUNE, REPO, run_cli

VENV_BIN = Path(sys.executable).absolute().parent


def _path_without(directory: Path) -> str:
    return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).absolute() != directory)


def _finished_run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "demo"
    (run / "adapter").mkdir(parents=True)
    (run / "tensorboard").mkdir()
    (run / "report.html").write_text("<html></html>")
    return run


def test_next_commands_run_as_printed_without_an_activated_venv(tmp_path, monkeypatch):
    """`finetune: command not found` after the README set-up (the venv is not activated): the `next:`
    block names the venv's own scripts, and each printed program really starts."""
    from finetune.cli.train import next_steps_lines

    monkeypatch.setenv("PATH", _path_without(VENV_BIN))
    run = _finished_run(tmp_path)
    lines = next_steps_lines(run, ["adapter"])
    commands = [line.split("  #")[0].strip() for line in lines[1:]]
    programs = {shlex.split(c)[0] for c in commands if not c.endswith("report.html")}
    assert programs == {str(VENV_BIN / "finetune"), str(VENV_BIN / "tensorboard")}, lines
    assert not any(c.startswith("open ") for c in commands), lines  # macOS only
    if not (VENV_BIN / "finetune").is_file():
        pytest.skip("no installed entry point")
    started = subprocess.run([str(VENV_BIN / "finetune"), "--version"], capture_output=True, text=True,
                             env={**os.environ, "PATH": _path_without(VENV_BIN)}, timeout=60)
    assert started.returncode == 0 and started.stdout.startswith("finetune "), started.stderr


def test_next_commands_say_finetune_where_path_finds_it(tmp_path, monkeypatch):
    from finetune.cli.train import next_steps_lines
    from finetune.train.report import next_steps

    monkeypatch.setenv("PATH", os.pathsep.join([str(VENV_BIN), _path_without(VENV_BIN)]))
    run = _finished_run(tmp_path)
    text = "\n".join(next_steps_lines(run, ["adapter"]))
    if not (VENV_BIN / "finetune").is_file():
        pytest.skip("no installed entry point")
    assert f"  finetune chat {run}" in text and f"  tensorboard --logdir {run}/tensorboard" in text
    assert ("talk to it (--prompt TEXT for one answer)", f"finetune chat {run}") in \
        next_steps(run, {"objective": "sft", "output": "adapter"})


def test_report_link_is_xdg_open_on_a_linux_desktop_and_the_path_on_a_server(tmp_path, monkeypatch):
    from finetune import hints

    if not sys.platform.startswith("linux"):
        pytest.skip("Linux behaviour")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert hints.open_file(Path("/r/report.html")) is None
    opener = bin_dir / "xdg-open"
    opener.write_text("#!/bin/sh\n")
    opener.chmod(0o755)
    monkeypatch.setenv("DISPLAY", ":0")  # a desktop; without a display xdg-open opens nothing (tests/export/test_export.py)
    assert hints.open_file(Path("/r/report.html")) == "xdg-open /r/report.html"


def test_doctor_fix_names_this_environments_pip(monkeypatch):
    from finetune import hints

    monkeypatch.setenv("PATH", _path_without(VENV_BIN))
    if not (VENV_BIN / "pip").is_file():
        pytest.skip("no pip beside the interpreter")
    assert hints.runnable("pip install -U 'peft>0.13.0'") == f"{VENV_BIN / 'pip'} install -U 'peft>0.13.0'"


def _setup_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Set up a fresh machine", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_setup_lines_run_twice(tmp_path):
    """The demo line trains into runs/demo; a second run of the same line must not stop on the finished
    run directory the first one left (checked with --dry-run: what a real run would do)."""
    lines = _setup_lines()
    assert len(lines) == 2
    demo = [part.strip() for part in lines[0].split("&&") if "finetune train" in part][0]
    args = shlex.split(demo)[2:]  # after `.venv/bin/finetune train`
    from finetune.recipe import load_recipe
    from finetune.rundir.layout import write_run_dir

    run = tmp_path / "runs" / "demo"
    write_run_dir(load_recipe(REPO / "recipes" / "demo.yaml"), run, world_size=2)  # what the first line left
    (run / "summary.json").write_text("{}")
    args = [str(REPO / a) if a.endswith(".yaml") else a for a in args]
    second = run_cli("train", *args, "--dry-run", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"# a real run would replace the previous run in {run}" in second.stdout
    assert "source .venv/bin/activate" in (REPO / "README.md").read_text()


# ---- item 5: plan tells the truth in its exit code and advice

def test_plan_exit_code_says_does_not_fit():
    recipe = REPO / "recipes" / "llama3" / "8b_qlora_2x12gb.yaml"
    fits = run_cli("plan", recipe)
    assert fits.returncode == 0 and ": fits" in fits.stdout
    default_loss = ("--set", "training.loss_kernel=default")  # written: auto would pick the chunked loss, which fits
    over = run_cli("plan", recipe, "--gpu-memory", "8GiB", *default_loss)
    assert over.returncode == 3 and "does NOT fit" in over.stdout, over.stdout
    assert run_cli("plan", recipe, "--gpu-memory", "8GiB", "--format", "json", *default_loss).returncode == 3
    assert run_cli("plan", recipe, "--gpu-memory", "80GiB", "--format", "json").returncode == 0
    # issue 35: left auto, the loss kernel is the chunked one where the logits stand in the way, and plan says why
    auto = run_cli("plan", recipe, "--gpu-memory", "8GiB")
    assert auto.returncode == 0 and 'training.loss_kernel = "chunked": the logits' in auto.stdout, auto.stdout


def test_recommend_tries_the_chunked_loss_before_a_smaller_batch_or_offload():
    """8B QLoRA on 2x 8.5 GiB (decided on the upper bound): the 2.9 GiB of fp32 logits are the cheap fix (chunked
    loss), not micro batch 1 with 16 accumulation steps, nor any offload; the reasons are sentences with no
    negative saving. (At 9 GiB ZeRO-1 at micro batch 1 with the chunked loss fits by 0.01 GiB, and the ranking
    prefers it to ZeRO-3's communication: a margin too thin to test on.)"""
    out = run_cli("plan", REPO / "recipes" / "llama3" / "8b_qlora_2x12gb.yaml", "--gpu-memory", "8.5GiB", "--recommend",
                  "--set", "training.loss_kernel=default")  # written (auto would choose the chunked loss itself)
    assert out.returncode == 3
    apply = [line for line in out.stdout.splitlines() if "apply with:" in line][0]
    assert "training.loss_kernel=chunked" in apply and "micro_batch_size" not in apply and "offload_param" not in apply
    reasons = [line.split("why: ", 1)[1] for line in out.stdout.splitlines() if "why: " in line]
    assert reasons and all(r[0].isupper() and r.endswith(".") for r in reasons), reasons
    assert not re.search(r"saves -\d", out.stdout)


def test_recommend_reasons_never_save_a_negative_amount():
    from finetune import plan as planner

    for args in (dict(model="llama-3-8b", method="qlora", zero="3"), dict(model="qwen2.5-0.5b", method="full", zero="2"),
                 dict(model="llama-3-8b", method="lora", zero="2", seq_len=4096, micro_batch=4)):
        recipe = planner.recipe_without_file(planner.flag_overrides(**{
            "offload_optimizer": None, "offload_param": None, "micro_batch": None, "seq_len": None,
            "gradient_checkpointing": None, "lora_r": None, "lora_targets": None, "attn": None, **args}))
        for gpus in (1, 2, 8):
            setup = planner.setup_from_recipe(recipe, gpus, 12 * 2**30, None, None)
            advice = planner.recommend(setup)
            assert not any(re.search(r"-\d+\.\d+ GiB", r) for r in advice.reasons), advice.reasons


# ---- item 8: doctor knows the DeepSpeed releases that broke training

def _facts(deepspeed):
    from finetune.run.machine import Facts

    return Facts(python="3.11.9", platform="Linux", packages={"deepspeed": deepspeed})


@pytest.mark.parametrize("version,broken", [
    ("0.16.3", set()), ("0.16.4", {"7116"}), ("0.16.5", {"7116", "7203"}), ("0.16.7", {"7116"}),
    ("0.16.8", set()), ("0.17.5", set()), ("0.17.6", {"7718"}), ("0.18.2", {"7718"}), ("0.18.3", set()),
])
def test_doctor_names_broken_deepspeed_releases(version, broken):
    from finetune.run.doctor import deepspeed_release_checks

    checks = deepspeed_release_checks(_facts(version))
    assert {c.name.rsplit(".", 1)[1] for c in checks} == broken
    assert all(c.status == "warn" and "deepspeedai/DeepSpeed#" in c.message and c.fix.startswith("pip install -U 'deepspeed")
               for c in checks)


def test_a_recipe_on_a_broken_release_is_refused_with_the_issue_named():
    from finetune.run.doctor import deepspeed_release_checks
    from tests.conftest import hub_recipe

    zero2 = hub_recipe(deepspeed={"stage": 2})
    zero3 = hub_recipe(deepspeed={"stage": 3}, training={"gradient_checkpointing": True})
    [check] = deepspeed_release_checks(_facts("0.17.6"), zero2)
    assert check.status == "fail" and "#7718" in check.message and "'deepspeed>=0.18.3'" in check.fix
    assert deepspeed_release_checks(_facts("0.17.6"), zero3) == []
    assert {c.status for c in deepspeed_release_checks(_facts("0.16.4"), zero3)} == {"fail"}
    saves = hub_recipe(deepspeed={"stage": 3}, lora={"modules_to_save": ["lm_head"]})
    assert [c.status for c in deepspeed_release_checks(_facts("0.19.8"), saves)] == ["warn"]
    assert deepspeed_release_checks(_facts("0.19.8"), zero3) == []
    # a recipe that trains without DeepSpeed's engine uses no ZeRO stage: as written, or as `auto` decides on one
    # GPU for LoRA (the recipe train's preflight checks is the decided one)
    plain = hub_recipe(deepspeed={"stage": 2, "enabled": False})
    assert deepspeed_release_checks(_facts("0.17.6"), plain) == []
    from finetune.plan.auto import Machine, resolve

    decided = resolve(hub_recipe(deepspeed={"stage": 2}), Machine(gpus_per_node=1, nodes=1, on_gpu=True)).recipe
    assert decided.deepspeed.enabled is False and deepspeed_release_checks(_facts("0.17.6"), decided) == []


def test_the_installed_deepspeed_against_the_table():
    """What `finetune doctor` says about this machine's DeepSpeed is what the table says about its version."""
    import json

    from finetune.run.bad_releases import matching
    from finetune.run.machine import package_version

    installed = package_version("deepspeed")
    if installed is None:
        pytest.skip("deepspeed is not installed")
    out = run_cli("doctor", "--format", "json")
    named = {c["name"] for c in json.loads(out.stdout)["checks"] if c["name"].startswith("deepspeed.release.")}
    expected = {f"deepspeed.release.{row.issue.split('#')[1].split(',')[0]}" for row in matching(installed)
                if row.severity == "fail"}
    assert named == expected, (installed, named)


# ---- item 4: data errors that name the fix

def _jsonl(path: Path, rows) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_missing_column_is_one_line_naming_the_rows_and_the_fix(tmp_path):
    _jsonl(tmp_path / "chats.jsonl", [{"dialog": [{"role": "user", "content": f"hi {i}"},
                                                 {"role": "assistant", "content": "yo"}]} for i in range(50)])
    (tmp_path / "r.yaml").write_text('model: {name_or_path: "builtin:tiny-llama"}\ndata: {path: chats.jsonl, format: messages}\n')
    out = run_cli("train", tmp_path / "r.yaml", "--dry-run", cwd=tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: dataset {tmp_path / 'chats.jsonl'}: lines 1-50 (50 rows): no `messages` column (format messages "
                      "needs a list of turns; found `dialog`); add `columns: {messages: dialog}` to the data source",
                      "error: preflight failed (50 problems); nothing was started or written"], out.stderr


def test_alpaca_response_column_names_columns_output(tmp_path):
    from finetune.data.validate import validate
    from finetune.data.formats import RowSpec
    from finetune.data.sources import Source

    path = _jsonl(tmp_path / "a.jsonl", [{"instruction": "q", "response": "a"}] * 3 + [{"instruction": "q", "output": 1}])
    assert validate([Source(str(path), "train", RowSpec("alpaca"))]).messages() == [
        f"{path}: lines 1-3 (3 rows): no `output` column (format alpaca needs it; found `instruction`, `response`); "
        "add `columns: {output: response}` to the data source",
        f"{path}:4: `output` must be text, got int"]


def test_a_wrong_data_path_says_where_it_looked_and_what_is_close(tmp_path):
    _jsonl(tmp_path / "chats.jsonl", [{"text": "x"}])
    (tmp_path / "r.yaml").write_text('model: {name_or_path: "builtin:tiny-llama"}\ndata: {path: chat.jsonl, format: text}\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_cli("lint", tmp_path / "r.yaml", cwd=elsewhere)
    assert out.returncode == 1
    assert (f"error R109 `data.path`: {tmp_path / 'chat.jsonl'}: file does not exist; "
            f"did you mean `{tmp_path / 'chats.jsonl'}`?") in out.stdout, out.stdout


def test_lint_errors_on_a_misspelled_builtin_model_and_hints_quotes_in_flow_style(tmp_path):
    (tmp_path / "b.yaml").write_text('model: {name_or_path: "builtin:tiny-lama"}\ndata: {path: org/d}\n')
    (tmp_path / "f.yaml").write_text("model: {name_or_path: builtin:tiny-llama}\ndata: {path: org/d}\n")
    out = run_cli("lint", tmp_path / "b.yaml", tmp_path / "f.yaml")
    assert out.returncode == 1
    assert "error R122 `model.name_or_path`: unknown built-in model `builtin:tiny-lama`" in out.stdout
    assert "fix: did you mean `builtin:tiny-llama`?" in out.stdout
    assert 'must be quoted, e.g. `{name_or_path: "builtin:tiny-llama"}`' in out.stdout


# ---- item 10 (and the loading lines of item 3): eval --data keeps its own file; chat says its prompt format

@pytest.fixture
def full_run(tmp_path, tiny_dir):
    """A run directory of a full fine-tune whose model/ is the built-in tiny model (nothing trained: what
    is checked is what the commands say and write, not the numbers)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_dir, run / "model")
    data = tmp_path / "five.jsonl"
    data.write_text("".join((REPO / "recipes" / "data" / "demo_instructions.jsonl").read_text().splitlines(True)[:5]))
    (run / "recipe.yaml").write_text('name: run\nmodel: {name_or_path: "builtin:tiny-llama", dtype: float32}\n'
                                     f"method: full\ndata: {{path: {data}, format: alpaca, max_length: 64}}\n")
    return run, data


def _cli(*args, tiny_cache):
    from tests.train_fixtures import runner_env

    return subprocess.run([*FINETUNE, *map(str, args)], cwd=REPO, env=runner_env(tiny_cache),
                          capture_output=True, text=True, timeout=300)


def test_eval_data_file_writes_its_own_result_and_says_it_is_loading(full_run, tiny_cache):
    run, data = full_run
    (run / "eval.json").write_text('{"the": "run\'s own numbers"}')
    out = _cli("eval", run, "--data", data, "--device", "cpu", tiny_cache=tiny_cache)
    assert out.returncode == 0, out.stderr
    assert (run / "eval.json").read_text() == '{"the": "run\'s own numbers"}'
    assert json_of(run / "eval-five.json")["sequences"] == 5
    lines = out.stderr.splitlines()
    assert lines[0] == f"loading {run}/model ...", out.stderr
    assert lines[-1] == f"wrote {run / 'eval-five.json'}"
    assert "Generating train split" not in out.stderr and "gemm_4bit_forward" not in out.stderr


def test_chat_prompt_says_which_prompt_format_it_used(full_run, tiny_cache):
    run, _ = full_run
    out = _cli("chat", run, "--prompt", "Name a colour.", "--max-new-tokens", 2, "--device", "cpu", tiny_cache=tiny_cache)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [f"loading {run}/model ...", "prompt format: alpaca (as the run trained), cpu"]
    from finetune.cli.chat import _format_why
    from finetune.use.chat import resolve_source

    shared = resolve_source(run, fmt="sharegpt")  # trained through the chat template: prompted like messages
    assert shared.fmt == "messages" and _format_why(shared, "sharegpt") == "--format"
    assert "sharegpt" in run_cli("chat", "--help").stdout


def json_of(path: Path):
    import json

    return json.loads(path.read_text())


# ---- item 7: preference runs fully reported; lint, render and the run agree on use_reentrant

def test_lora_under_zero3_checkpoints_reentrant_in_render_lint_and_model():
    from finetune.render import reentrant_checkpointing, render_training_args
    from tests.conftest import hub_recipe

    lora3 = hub_recipe(deepspeed={"stage": 3})
    assert render_training_args(lora3)["gradient_checkpointing_kwargs"] == {"use_reentrant": True}
    assert render_training_args(hub_recipe(deepspeed={"stage": 2}))["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    full3 = hub_recipe(method="full", deepspeed={"stage": 3})
    assert not reentrant_checkpointing(full3)


def test_trl_keeps_our_reentrant_setting_for_peft_under_zero3():
    """TRL's DPOTrainer forces use_reentrant=True for PEFT + ZeRO-3 + checkpointing and logs that it does when
    it was False: what render passes is what TRL keeps, so no such line (read from the installed TRL)."""
    import inspect

    trl = pytest.importorskip("trl")
    source = inspect.getsource(trl.DPOTrainer.__init__)
    assert 'args.gradient_checkpointing_kwargs["use_reentrant"] = True' in source  # still TRL's rule
    from finetune.render import render_training_args
    from tests.conftest import hub_recipe

    for stage in (3,):
        kwargs = render_training_args(hub_recipe(objective="dpo", deepspeed={"stage": stage}))["gradient_checkpointing_kwargs"]
        assert kwargs["use_reentrant"] is True


def test_orpo_batches_count_their_tokens():
    """transformers' Trainer counts tokens of `input_ids` only; ORPO/CPO batches have chosen_*/rejected_*."""
    import torch

    from finetune.train.preference import _counting_pairs

    class Base:
        def _track_num_input_tokens(self, inputs):
            raise AssertionError("a batch with input_ids goes to the Trainer's own count")

    trainer = _counting_pairs(Base)()
    trainer.args = type("A", (), {"include_num_input_tokens_seen": "non_padding", "device": "cpu"})()
    trainer.state = type("S", (), {"num_input_tokens_seen": 0})()
    trainer.accelerator = type("X", (), {"gather": staticmethod(lambda t: t.reshape(1))})()
    trainer._track_num_input_tokens({"chosen_input_ids": torch.ones(2, 5), "chosen_attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0]]),
                                     "rejected_attention_mask": torch.tensor([[1] * 4 + [0], [1] * 5]),
                                     "prompt_attention_mask": torch.ones(2, 3)})
    assert trainer.state.num_input_tokens_seen == 8 + 9
    assert type(trainer).__name__ == "Base"


def test_report_shows_reward_curves_of_a_preference_run(tmp_path):
    import json

    from finetune.train.report import REWARD_PLOT_FILE, write_run_report

    pytest.importorskip("matplotlib")
    history = [{"step": s, "loss": 0.69 - s / 100, "learning_rate": 1e-3, "rewards/chosen": s / 10, "rewards/rejected": -s / 10,
                "rewards/margins": s / 5, "rewards/accuracies": min(1.0, s / 4)} for s in range(1, 9)]
    (tmp_path / "summary.json").write_text(json.dumps({"objective": "dpo", "steps": 8, "preference_metrics": {
        "rewards/margins": {"first": 0.2, "last": 1.6}}}))
    write_run_report(tmp_path, history)
    page = (tmp_path / "report.html").read_text()
    assert (tmp_path / REWARD_PLOT_FILE).is_file() and "Preference rewards" in page
    assert 'alt="rewards: chosen, rejected, margins, accuracies" src="data:image/png;base64,' in page
    assert "<td>rewards/margins</td><td>0.2000 -&gt; 1.6000</td>" in page
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "summary.json").write_text(json.dumps({"objective": "sft"}))
    write_run_report(sft, [{"step": 1, "loss": 1.0}])
    assert not (sft / REWARD_PLOT_FILE).exists() and "Preference rewards" not in (sft / "report.html").read_text()


# ---- item 2: one line per event on screen, the whole story in the run directory

def test_a_dpo_log_dict_is_one_short_line_on_the_terminal():
    import io

    from rich.console import Console

    from finetune.run.progress import TrainingDisplay

    dict_line = ("[rank0]: {'loss': '0.5928', 'grad_norm': '1.007', 'learning_rate': '0.005', 'entropy': '6.249', "
                 "'num_tokens': '732', 'logits/chosen': '0.007867', 'logits/rejected': '-0.00253', 'mean_token_accuracy': '0', "
                 "'rewards/chosen': '-0.1072', 'rewards/rejected': '-0.3343', 'rewards/accuracies': '0.75', "
                 "'rewards/margins': '0.2271', 'logps/chosen': '-52.12', 'logps/rejected': '-75.2', 'epoch': '0.1'}\n")
    totals = "[rank0]: {'train_runtime': '11.31', 'train_samples_per_second': '4.243', 'train_loss': '0.5862', 'epoch': '0.3'}\n"
    out = io.StringIO()
    with TrainingDisplay(Console(file=out, force_terminal=True, width=200)) as display:
        display.write(dict_line.encode() + totals.encode())
    shown = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line) for line in out.getvalue().splitlines()
             if "epoch" in line or "train_runtime" in line]
    assert shown == ["epoch 0.10: loss 0.5928, lr 0.005, grad norm 1.01, margins 0.227, accuracy 0.75"], out.getvalue()


def test_launcher_banners_stay_in_the_launcher_log(tmp_path):
    import io

    from finetune.run.launch.supervision import Relay

    lines = [b"*****************************************\n",
             b"Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid ...\n",
             b"*****************************************\n",
             b"[rank0]: DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n",
             b"[rank0]: [finetune] parameters: 65,536 trainable of 853,120 (lora)\n"]
    console = io.BytesIO()
    # issue 34: torchrun's report of the Ctrl-C (or SIGTERM) the user sent, traceback and SignalException
    stopped = [b"W1127 14:58:05.886000 30447 torch/distributed/elastic/agent/server/api.py:753] Received 15 death "
               b"signal, shutting down workers\n",
               b"W1127 14:58:05.886000 30447 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process "
               b"30514 closing signal SIGTERM\n",
               b"Traceback (most recent call last):\n", b'  File "<frozen runpy>", line 198, in _run_module_as_main\n',
               b"    raise SignalException(f\"Process {os.getpid()} got signal: {sigval}\", sigval=sigval)\n",
               b"torch.distributed.elastic.multiprocessing.api.SignalException: Process 30447 got signal: 15\n"]
    console = io.BytesIO()
    relay = Relay(io.BytesIO(b"".join(lines + stopped)), console, tmp_path / "launcher.log")
    relay.run()
    assert console.getvalue() == lines[-1] + stopped[1]
    assert (tmp_path / "launcher.log").read_bytes() == b"".join(lines + stopped)


# ---- item 6: the examples in --help are real output (re-run here, or the README's recorded demo run)

def _example_sessions(command: str) -> list[tuple[str, list[str]]]:
    """[(`$ ...` line, the output lines shown under it)] of `finetune COMMAND --help`'s Example block."""
    text = run_cli(command, "--help").stdout.split("Example:", 1)[1]
    sessions: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            sessions.append((line[2:], []))
        elif sessions and line:
            sessions[-1][1].append(line)
        elif sessions:
            break  # the blank line that ends the block
    return sessions


def _pattern(line: str) -> "re.Pattern":
    return re.compile(".*".join(re.escape(part) for part in line.split("…")) + r"\Z")


def _assert_shown(expected: list[str], actual: list[str]) -> None:
    """Every example line (but `...`) is an output line, in order; `…` stands for any text."""
    position = 0
    for want in expected:
        if want == "...":
            continue
        pattern = _pattern(want)
        hits = [i for i in range(position, len(actual)) if pattern.match(actual[i].strip())]
        assert hits, f"example line not in the real output: {want!r}\n" + "\n".join(actual)
        position = hits[0] + 1


def _readme_session(command: str) -> list[str]:
    readme = (REPO / "README.md").read_text().splitlines()
    start = readme.index(f"$ {command}")
    out = []
    for line in readme[start + 1:]:
        if not line.strip() or line.startswith("$ ") or line.startswith("```"):
            break
        out.append(line)
    return out


@pytest.mark.parametrize("command", ["lint", "plan"])
def test_help_examples_are_what_the_command_prints(command):
    for typed, shown in _example_sessions(command):
        if typed == "echo $?":
            assert int(shown[0]) == last.returncode
            continue
        last = run_cli(*shlex.split(typed)[1:])
        if shown:
            _assert_shown(shown, (last.stdout + last.stderr).splitlines())


def test_train_help_example_is_a_dry_run_and_the_readme_demo(tmp_path, monkeypatch):
    # as a user's shell has it: a test module that imports DeepSpeed may have set it in this process
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    [(typed, shown)] = _example_sessions("train")
    dry = run_cli(*shlex.split(typed)[1:], "--output-dir", tmp_path / "runs" / "demo", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    notes = [line for line in shown if line.startswith("note:")]
    _assert_shown(notes, dry.stderr.splitlines())
    [launching] = [line for line in shown if line.startswith("launching ")]
    _assert_shown([launching.split(": ", 1)[1]], dry.stdout.splitlines())  # the command a dry run prints
    readme = (REPO / "README.md").read_text().splitlines()
    _assert_shown([line for line in shown if line.startswith(("[finetune] done", "finished:"))], readme)


@pytest.mark.parametrize("command", ["chat", "eval"])
def test_chat_and_eval_help_examples_are_the_recorded_demo_run(command):
    """The demo's numbers and answers come from one recorded run, shown in README's "What you get" (which
    the issue-24 reviewer reproduced to the digit); help shows the same session."""
    sessions = _example_sessions(command)
    typed, shown = sessions[0]
    assert shown == _readme_session(typed)


def test_recipe_comments_quote_what_plan_prints():
    from finetune import plan as planner
    from finetune.recipe import load_recipe

    path = REPO / "recipes" / "llama3" / "8b_qlora_2x12gb.yaml"
    quoted = re.search(r"`finetune plan` shows ([\d.]+) -> ([\d.]+) GiB per GPU with 1e8", path.read_text())
    assert quoted, "the comment this test checks moved"
    totals = []
    for sets in (["deepspeed.stage3_max_live_parameters=1000000000"], []):
        recipe = load_recipe(path, sets).recipe
        setup = planner.setup_from_recipe(recipe, None, None, None, None, data_lengths=False)
        totals.append(f"{planner.plan(setup).per_gpu['total'] / 2**30:.2f}")
    assert list(quoted.groups()) == totals


# ---- item 9: your own data in five minutes

def _walkthrough() -> list[str]:
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Your own data in five minutes", 1)[1].split("```", 2)[1]
    return block.strip("\n").splitlines()


def test_readme_walkthrough_runs_as_written(tmp_path):
    """init, data show and a dry run of train on a question/answer file, as README's walk-through shows."""
    import json

    rows = [("What is 2+2?", "4"), ("Name a colour.", "Red."), ("Capital of France?", "Paris.")] * 20
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    lines = _walkthrough()
    sessions: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            sessions.append((line[2:].split("  #")[0].strip(), []))
        else:
            sessions[-1][1].append(line)
    ran = []
    for typed, shown in sessions:
        args = shlex.split(typed)[1:]
        if args[0] == "chat":
            continue  # needs the trained run
        if args[0] == "train":
            args.append("--dry-run")
        out = run_cli(*args, cwd=tmp_path)
        assert out.returncode == (3 if args[0] == "plan" and "does NOT fit" in out.stdout else 0), out.stderr
        ran.append(args[0])
        if shown:
            assert [line for line in (out.stdout + out.stderr).splitlines() if not line.startswith("loading ")] == shown
    assert ran == ["init", "data", "plan", "train"]
    assert "# a real run would start fresh in" in out.stdout


def test_init_reads_the_format_off_the_first_row_and_never_overwrites(tmp_path):
    from finetune.data.starter import StarterError, guess_format

    assert guess_format({"instruction": "q", "output": "a"}) == ("alpaca", {})
    assert guess_format({"prompt": "q", "response": "a"}) == ("alpaca", {"instruction": "prompt", "output": "response"})
    assert guess_format({"dialog": [{"role": "user", "content": "hi"}]}) == ("messages", {"messages": "dialog"})
    assert guess_format({"conversations": [{"from": "human", "value": "hi"}]}) == ("sharegpt", {})
    assert guess_format({"content": "x"}) == ("text", {"text": "content"})
    with pytest.raises(StarterError, match="cannot tell the format from the columns `a`, `b`"):
        guess_format({"a": 1, "b": 2})
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "d.yaml").write_text("mine\n")
    out = run_cli("init", "--data", tmp_path / "d.jsonl")
    assert out.returncode == 1 and "exists" in out.stderr and (tmp_path / "d.yaml").read_text() == "mine\n"


@pytest.mark.parametrize("row, objective", [
    ({"prompt": "What is 7 plus 0?", "chosen": "7.", "rejected": "No."}, "dpo"),
    ({"prompt": "What is 7 plus 0?", "completion": "7.", "label": True}, "kto"),
    ({"prompt": "What is 7 plus 0?", "solution": "7"}, "grpo"),
    ({"question": "What is 7 plus 0?"}, "grpo"),
    ({"question": "What is 7 plus 0?", "answer": "7"}, "sft"),
])
def test_init_writes_the_objective_its_rows_train_and_epochs_that_learn(tmp_path, row, objective):
    """Issue 34: init on prompt/chosen/rejected rows wrote an SFT recipe that trained on `chosen` ("lint: no
    problems"); its `epochs: 1` on 200 rows was 25 steps, and nothing said so."""
    import json

    from typer.testing import CliRunner

    from finetune.cli import app
    from finetune.lint import LintOptions, lint_paths
    from finetune.recipe import load_recipe

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for _ in range(200)))
    out = CliRunner().invoke(app, ["init", "--data", str(tmp_path / "d.jsonl")])
    assert out.exit_code == 0, out.output
    recipe = load_recipe(tmp_path / "d.yaml").recipe
    assert recipe.objective == objective
    assert [f for f in lint_paths([tmp_path / "d.yaml"], LintOptions()).findings if f.severity != "info"] == []
    per_step = 1 if objective == "grpo" else 8  # grpo: a step's 8 completions are one prompt's group
    assert recipe.training.epochs * 200 / per_step >= 100 or recipe.training.epochs == 10
    assert f"200 rows x {recipe.training.epochs:g} = " in out.output and "lint: no problems" in out.output
