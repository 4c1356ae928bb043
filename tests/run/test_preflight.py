"""`finetune train`'s preflight: every failure has a clear message, starts no process and writes nothing.

The CLI runs in-process (typer's CliRunner) with `finetune.run.launch.supervision.spawn` replaced, so a test would
notice any launch attempt. The dataset readers are tested in tests/data/test_validate.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from finetune.cli import app
from finetune.run.preflight import Preflight, model_step, output_dir_problem
from finetune.recipe import Recipe, load_recipe
from finetune.rundir.layout import write_run_dir
from finetune.rundir.names import RECIPE_HEADER
from tests.conftest import write_local_inputs

ALPACA = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"},
          {"instruction": "Capital of France?", "output": "Paris"}]
MESSAGES = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A folder with a good dataset, a local model directory and a recipe using both."""
    monkeypatch.chdir(tmp_path)
    write_local_inputs(tmp_path)
    write_jsonl(tmp_path / "data.jsonl", ALPACA)
    return tmp_path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def recipe_file(folder: Path, extra: str = "", data: str = "data.jsonl", model: str = "./model") -> Path:
    path = folder / "r.yaml"
    path.write_text(f"model: {{name_or_path: {model}, dtype: float32}}\ndata: {{path: {data}}}\n{extra}")
    return path


def train(*args: str):
    return CliRunner().invoke(app, ["train", *map(str, args)])


def assert_refused(result, out: Path, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert "nothing was started or written" in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert "Traceback" not in result.output
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Through the CLI


def test_missing_dataset(workspace, no_launch):
    result = train(recipe_file(workspace, data="./nope.jsonl"), "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "nope.jsonl: file does not exist")
    assert not no_launch


def test_wrong_columns(workspace, no_launch):
    write_jsonl(workspace / "chat.jsonl", MESSAGES)
    result = train(recipe_file(workspace, data="chat.jsonl"), "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "chat.jsonl:1: no `instruction` column",
                   "did you mean format: messages?")


def test_missing_model(workspace, no_launch):
    result = train(recipe_file(workspace, model="./weights"), "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "model.name_or_path", "weights: directory does not exist")


def test_model_directory_without_config(workspace, no_launch):
    (workspace / "empty_model").mkdir()
    result = train(recipe_file(workspace, model="./empty_model"), "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "no config.json")


def test_occupied_output_directory(workspace, no_launch):
    out = workspace / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = train(recipe_file(workspace), "--output-dir", out)
    assert result.exit_code == 1
    assert f"output directory {out} is not empty (notes.txt) and is not a run directory" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # --overwrite never deletes a folder that is not a run directory; issue 34 item 3: not even one holding the
    # recipe being run as recipe.yaml (it used to count as a run directory, and went with the user's code)
    (out / "src").mkdir()
    (out / "recipe.yaml").write_text(recipe_file(workspace).read_text())
    for extra in ((), ("--dry-run",)):
        result = train(out / "recipe.yaml", "--output-dir", out, "--overwrite", *extra)
        assert result.exit_code == 1 and f"output directory {out} is not empty (notes.txt, recipe.yaml, src) and is " \
            "not a run directory `finetune train` wrote" in result.stderr, result.output
        assert "would replace" not in result.output and "replace the previous run" not in result.output
    assert (out / "notes.txt").read_text() == "mine" and (out / "src").is_dir()
    assert not no_launch


def test_invalid_recipe(workspace, no_launch):
    result = train(recipe_file(workspace, extra="lora: {rr: 8}\n"), "--output-dir", workspace / "out")
    assert result.exit_code == 1
    assert "r.yaml:3:8: `lora.rr` unknown key (did you mean `r`?)" in result.stderr
    assert not (workspace / "out").exists() and not no_launch


def test_lint_error_stops_the_run(workspace, no_launch):
    result = train(recipe_file(workspace, extra="launch: {nodes: 1, node_rank: 1}\n"), "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "node_rank 1 with only 1 node(s)")
    assert "r.yaml:3:" in result.stderr  # the lint report points at the line


def test_every_problem_is_reported_at_once(workspace, no_launch):
    out = workspace / "out"
    out.mkdir()
    (out / "x").write_text("")
    result = train(recipe_file(workspace, data="./nope.jsonl", model="./weights"), "--output-dir", out)
    assert result.exit_code == 1
    assert "nope.jsonl" in result.stderr and "weights" in result.stderr and "is not empty" in result.stderr
    assert "(3 problems)" in result.stderr


def test_dry_run_prints_the_command_and_config_and_writes_nothing(workspace, no_launch):
    out = workspace / "out"
    result = train(recipe_file(workspace, extra="launch: {procs_per_node: 2, master_port: 29555}\n"),
                   "--output-dir", out, "--dry-run", "--set", "training.micro_batch_size=3")
    assert result.exit_code == 0, result.output
    command, _, config = result.stdout.partition("# deepspeed.json\n")
    assert "-m torch.distributed.run --nnodes 1 --nproc-per-node 2" in command
    assert f"-m finetune.train.runner --run-dir {out}" in command
    assert json.loads(config)["train_batch_size"] == 6  # 3 per process x 2 processes
    assert not out.exists() and not no_launch


def test_hub_model_is_a_warning_not_an_error(workspace, no_launch):
    result = train(recipe_file(workspace, model="org/never-downloaded-model"), "--output-dir", workspace / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "warning: model org/never-downloaded-model: a hub id, not in the local cache" in result.stderr


# ----------------------------------------------------------------------------------------------
# Model and output directory


def test_unknown_builtin_model():
    result = Preflight()
    recipe = Recipe.model_validate({"model": {"name_or_path": "builtin:huge-llama"}, "data": {"path": "org/d"}})
    model_step(recipe, result)
    assert "unknown built-in model `builtin:huge-llama`" in result.errors[0]


def test_output_directory_policy(tmp_path):
    assert output_dir_problem(tmp_path / "new", overwrite=False) is None
    (tmp_path / "empty").mkdir()
    assert output_dir_problem(tmp_path / "empty", overwrite=False) is None
    (tmp_path / "file").write_text("")
    assert "not a directory" in output_dir_problem(tmp_path / "file", overwrite=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("")
    for overwrite in (False, True):  # a recipe.yaml alone does not make a run directory
        assert "is not a run directory" in output_dir_problem(run, overwrite=overwrite)
    (run / "recipe.yaml").write_text(RECIPE_HEADER + " from r.yaml\n")
    for name in ("deepspeed.json", "training_args.json"):
        (run / name).write_text("{}")
    assert "pass --overwrite" in output_dir_problem(run, overwrite=False)
    assert output_dir_problem(run, overwrite=True) is None


def test_run_directory_contents(workspace):
    loaded = load_recipe(recipe_file(workspace, extra="training: {micro_batch_size: 2}\n"))
    run = write_run_dir(loaded, workspace / "runs" / "one", world_size=4)
    assert sorted(p.name for p in run.iterdir()) == ["deepspeed.json", "format.json", "logs", "recipe.yaml", "resume_key.json",
                                                     "training_args.json"]
    again = load_recipe(run / "recipe.yaml").recipe
    assert again.data.path == str(workspace / "data.jsonl") and again.model.name_or_path == str(workspace / "model")
    assert again.output_dir == str(run)
    assert again.model_dump(exclude={"data", "model", "output_dir", "extends"}) == \
        loaded.recipe.model_dump(exclude={"data", "model", "output_dir", "extends"})
    assert json.loads((run / "deepspeed.json").read_text())["train_batch_size"] == 8  # 2 x 1 x 4
    assert json.loads((run / "training_args.json").read_text())["output_dir"] == str(run)


def test_run_name_escaping_runs_is_refused_and_run_directory_printed(workspace, no_launch):
    result = train(recipe_file(workspace, extra="name: ../../x\noutput_dir: runs/{name}\n"))
    assert result.exit_code == 1 and "`name`" in result.stderr and "path separators" in result.stderr
    assert not (workspace.parent.parent / "x").exists() and not no_launch
    result = train(recipe_file(workspace, extra="name: demo\n"), "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"note: run directory: {workspace / 'runs' / 'demo'}" in result.stderr


@pytest.mark.parametrize("template,needle", [
    ("{% for m in messages %}{{ m.content.__class__.__mro__ }}{% endfor %}", "SecurityError"),  # sandbox refuses
    ("{% for m in messages %}{% set _ = messages.append(m) %}{% endfor %}", "SecurityError"),  # immutable sandbox
    ("{% for m in messages %}{{ m.content }}", "template line 1"),  # unclosed for
    ("{% if messages[0].role != 'system' %}{{ raise_exception('needs a system turn') }}{% endif %}", "needs a system turn"),
])
def test_chat_template_is_rendered_on_the_first_rows_before_launch(workspace, no_launch, template, needle):
    write_jsonl(workspace / "chat.jsonl", MESSAGES)
    extra = f"data: {{path: chat.jsonl, format: messages, chat_template: {json.dumps(template)}}}\n"
    path = workspace / "r.yaml"
    path.write_text(f"model: {{name_or_path: ./model, dtype: float32}}\n{extra}")
    result = train(path, "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "data.chat_template", "chat.jsonl:1", needle)
    assert not no_launch
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: data.chat_template")]
    assert len(errors) == 1


def test_a_working_chat_template_passes_preflight(workspace, no_launch):
    write_jsonl(workspace / "chat.jsonl", MESSAGES)
    # bos_token + ...: an undefined name would raise here; the tokenizer passes its special tokens
    template = ("{{ bos_token + '' }}{% for m in messages %}<{{ m.role }}>{{ m.content + eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    path = workspace / "r.yaml"
    path.write_text(f"model: {{name_or_path: ./model, dtype: float32}}\n"
                    f"data: {{path: chat.jsonl, format: messages, chat_template: {json.dumps(template)}}}\n")
    result = train(path, "--output-dir", workspace / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "error: data.chat_template" not in result.stderr


# ------------------------------------------------------------------------------------------------
# Issue 25 item 10: run directories no run can create, --overwrite through a link, pasted commands


@pytest.mark.parametrize("kind", ["dangling-link", "link-loop", "300-byte-name"])
def test_dry_run_refuses_a_run_directory_no_run_can_create(workspace, no_launch, kind):
    out = workspace / "out"
    extra = ""
    if kind == "dangling-link":
        out.symlink_to(workspace / "nowhere")
        expected = f"output directory {out}: a symbolic link to {workspace / 'nowhere'}, which does not exist"
    elif kind == "link-loop":
        out.symlink_to(workspace / "out2")
        (workspace / "out2").symlink_to(out)
        expected = f"output directory {out}: a symbolic link loop"
    else:
        out = workspace / ("n" * 300)
        extra = f"output_dir: {out}\n"
        expected = None  # the schema refuses it already (a finding, no dry run shown)
    args = [recipe_file(workspace, extra=extra), "--dry-run"] + ([] if extra else ["--output-dir", out])
    result = train(*args)
    assert result.exit_code == 1, result.output + repr(result.exception)
    if expected is None:
        assert "300 bytes" in result.output
    else:
        assert "# a real run would refuse: " in result.stdout and expected in result.stdout, result.output
    assert "Traceback" not in result.output and not no_launch


def test_overwrite_through_a_symlinked_run_directory_replaces_its_target(workspace):
    target = workspace / "disk" / "run"
    loaded = load_recipe(recipe_file(workspace))
    write_run_dir(loaded, target, world_size=2)
    (target / "old-output.txt").write_text("from the previous run")
    link = workspace / "run"
    link.symlink_to(target)
    write_run_dir(loaded, link, world_size=2, overwrite=True)
    assert link.is_symlink() and link.resolve() == target.resolve()  # the link stays, pointing at the new run
    assert not (target / "old-output.txt").exists() and (target / "recipe.yaml").is_file()
    assert sorted(p.name for p in workspace.iterdir() if p.name.startswith(".")) == []  # no `.run.old` link
    assert sorted(p.name for p in target.parent.iterdir()) == ["run"]


def test_printed_commands_are_shell_quoted(tmp_path):
    import shlex

    from finetune.cli.train import next_steps_lines
    from finetune.train.report import next_steps

    run = tmp_path / "$(touch PWNED) x"
    (run / "checkpoint-4").mkdir(parents=True)
    (run / "report.html").write_text("")
    lines = [line.split("  # ")[0].strip() for line in next_steps_lines(run, ["adapter"])[1:]]
    commands = lines + [command for _, command in next_steps(run, {"output": "adapter"})]
    assert len(commands) >= 7
    for command in commands:
        words = shlex.split(command)  # what a shell makes of the pasted line
        assert str(run) in words or any(w.startswith(str(run) + "/") for w in words), command
        assert command == " ".join(shlex.quote(word) for word in words), command  # every word quoted


def _chat_recipe(workspace: Path, template: str, rows: list) -> Path:
    write_jsonl(workspace / "chat.jsonl", rows)
    path = workspace / "r.yaml"
    path.write_text(f"model: {{name_or_path: ./model, dtype: float32}}\n"
                    f"data: {{path: chat.jsonl, format: messages, chat_template: {json.dumps(template)}}}\n")
    return path


def _turns(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}


def test_chat_template_is_rendered_on_every_row_not_only_the_first(workspace, no_launch):
    """Issue 25 item 9: a template that fails on row 51 passed a check of the first 20 rows."""
    template = ("{% for m in messages %}{% if m.content == 'q50' %}{{ raise_exception('no q50 here') }}{% endif %}"
                "<{{ m.role }}>{{ m.content }}{% endfor %}")
    result = train(_chat_recipe(workspace, template, [_turns(i) for i in range(60)]), "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "data.chat_template", "chat.jsonl:51", "no q50 here")


def test_a_chat_template_that_renders_no_reply_is_refused(workspace, no_launch):
    template = "{% for m in messages %}{% if m.role != 'assistant' %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
    result = train(_chat_recipe(workspace, template, [_turns(i) for i in range(3)]), "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "chat.jsonl:1", "holds none of the assistant's replies")


def test_the_check_renders_rows_as_tokenizing_does(workspace, no_launch):
    """Issue 39: preflight renders through finetune.data.chat_template, as tokenizing does, so a template whose
    assistant turns cannot be located is refused before launch, not in the launcher's tokenizing."""
    template = "{% for m in messages %}{% if loop.last %}[last]{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    result = train(_chat_recipe(workspace, template, [_turns(i) for i in range(3)]), "--output-dir", workspace / "out")
    assert_refused(result, workspace / "out", "data.chat_template", "chat.jsonl:1", "renders earlier turns differently")


def test_a_chat_template_too_slow_for_one_row_is_refused_in_bounded_time(workspace, no_launch, monkeypatch):
    import time

    import finetune.run.preflight as preflight

    monkeypatch.setattr(preflight, "TEMPLATE_ROW_SECONDS", 0.5)
    template = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    started = time.monotonic()
    result = train(_chat_recipe(workspace, template, [_turns(0)]), "--output-dir", workspace / "out")
    assert time.monotonic() - started < 30
    assert_refused(result, workspace / "out", "chat.jsonl:1", "did not finish rendering this conversation in 0.5 s")


def test_the_template_check_stops_at_its_budget_and_says_so(workspace):
    from finetune.run.preflight import Preflight, chat_template_step

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    recipe = load_recipe(_chat_recipe(workspace, template, [_turns(i) for i in range(50)])).recipe
    result = Preflight()
    chat_template_step(recipe, result, budget=0.0)
    assert not result.errors and "data.chat_template: rendered on the first 0 row(s) in 0 s" in result.notes[0]


@pytest.fixture
def hub(monkeypatch):
    """The hub look-up on, with huggingface_hub's model_info answering from `hub.known` (no network)."""
    import types

    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    from finetune.run.hub import CHECK_ENV

    state = types.SimpleNamespace(known={"meta-llama/Meta-Llama-3-8B-Instruct"}, calls=[], network=True)

    def model_info(self, repo_id, revision=None, timeout=None, **_):
        state.calls.append((repo_id, timeout))
        if not state.network:
            raise ConnectionError("[Errno -2] Name or service not known")
        if repo_id not in state.known:
            error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an httpx response
            Exception.__init__(error, f"404 Client Error: Repository Not Found for url: .../{repo_id}")
            raise error
        return types.SimpleNamespace(id=repo_id, gated=False)

    monkeypatch.setenv(CHECK_ENV, "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(HfApi, "model_info", model_info)
    monkeypatch.setattr("finetune.run.hub._cached", lambda repo_id, revision: False)
    return state


def test_a_misspelled_hub_id_is_refused_before_launch_with_did_you_mean_and_leaves_nothing(workspace, hub, monkeypatch):
    """Issue 34: `Meta-Llama-3-8B-Instuct` passed preflight, then 47-50 s of retries, "cannot write the run
    directory", an empty run directory, no suggestion. Now one request with a short timeout and one line."""
    from finetune.run.hub import TIMEOUT

    out = workspace / "out"
    result = train(recipe_file(workspace, model="meta-llama/Meta-Llama-3-8B-Instuct"), "--output-dir", out)
    assert result.exit_code == 1
    assert ("model meta-llama/Meta-Llama-3-8B-Instuct: not found on the Hugging Face Hub (a private one needs "
            "HF_TOKEN); did you mean meta-llama/Meta-Llama-3-8B-Instruct?") in result.stderr
    assert hub.calls == [("meta-llama/Meta-Llama-3-8B-Instuct", TIMEOUT)] and not out.exists()
    right = train(recipe_file(workspace, model="meta-llama/Meta-Llama-3-8B-Instruct"), "--output-dir", out, "--dry-run")
    assert right.exit_code == 0, right.output
    assert "on the Hugging Face Hub, not in the local cache: downloaded at launch" in right.stderr


def test_a_hub_id_offline_is_refused_with_one_line_that_says_so(workspace, hub, monkeypatch):
    out = workspace / "out"
    hub.network = False
    result = train(recipe_file(workspace, model="meta-llama/Meta-Llama-3-8B-Instruct"), "--output-dir", out)
    assert result.exit_code == 1 and not out.exists()
    assert "the Hub cannot be reached: offline? (ConnectionError: [Errno -2] Name or service not known)" in result.stderr
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = train(recipe_file(workspace, model="meta-llama/Meta-Llama-3-8B-Instuct"), "--output-dir", out)
    assert result.exit_code == 1 and not out.exists() and len(hub.calls) == 1  # offline: no request at all
    assert ("not in the local Hugging Face cache, and HF_HUB_OFFLINE is set: offline, it cannot be downloaded; "
            "did you mean meta-llama/Meta-Llama-3-8B-Instruct?") in result.stderr


def test_every_shipped_recipes_hub_model_is_in_the_planners_table_of_ids():
    from finetune.plan.archs import HUB_IDS, match_hub_id
    from finetune.recipe.references import is_model_path

    from finetune.vision_models import find_vision_model, published_hub_ids

    known = {i: name for name, ids in HUB_IDS.items() for i in ids}
    assert all(match_hub_id(i).name == name for i, name in known.items())
    assert all(find_vision_model(i) is not None for i in published_hub_ids())  # vision-language models
    known.update((i, "vlm") for i in published_hub_ids())
    for path in (Path(__file__).parents[2] / "recipes").rglob("*.yaml"):
        model = load_recipe(path).recipe.model.name_or_path
        if not model.startswith("builtin:") and not is_model_path(model):
            assert model in known, path
