"""`finetune eval RUN --tasks TASK.yaml`: benchmark tasks through lm-evaluation-harness, base and fine-tuned.

lm-eval (the `eval` extra) does the tasks: reading the task files (its YAML loader: `include`, `!function`), the
data (`dataset_path: json` with `data_files`), the requests, the metrics and their standard errors. finetune adds:
- the model, loaded as `finetune chat` loads it (the adapter on its base, QLoRA in 4-bit), handed to lm-eval's HFLM
  as a preloaded model; the base is the same model with the adapter switched off (a full fine-tune: the base
  loaded beside it);
- the prompt: lm-eval's chat-template hook (apply_chat_template) renders each request with `finetune chat`'s own
  prompt builder (finetune.use.chat.Conversation), and the request's context tokens are that builder's token ids,
  not a re-tokenization of its text. The answer is tokenized as training tokenizes a response (alpaca: on its
  own; a chat template or plain text: as part of the whole text, lm-eval's rule);
- offline: the hub is never asked (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), so a task reads local files only;
- a relative `data_files` path is read from the task file's folder (lm-eval alone reads it from the working
  directory), so a task travels with its data;
- the result: eval.json's `benchmarks` section (the loss eval's keys stay) and report.html's Evaluation section.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from finetune import objectives
from finetune.rundir.names import BENCHMARKS_KEY, EVAL_FILE
from finetune.use.evaluate import EvalError, write_record
INSTALL_HINT = "pip install 'finetune[eval]'"
# The statistics lm-eval reports beside each metric (`acc_stderr,none`): kept as the metric's stderr.
_STDERR = "_stderr"


@dataclass
class TaskScores:
    name: str
    file: str                                   # the task file's name (no folder: eval.json may be published)
    samples: int
    metrics: dict[str, dict[str, Optional[float]]] = field(default_factory=dict)  # metric -> base, fine_tuned, stderrs


@dataclass
class BenchmarkResult:
    tasks: list[TaskScores]
    prompt: str
    lm_eval: str
    seconds: float

    def table(self) -> str:
        rows = [("task", "metric", "base", "fine-tuned")]
        for task in self.tasks:
            for metric, values in task.metrics.items():
                rows.append((task.name, metric, _fmt(values.get("base")), _fmt(values.get("fine_tuned"))))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}" for a, b, c, d in rows]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {"lm_eval": self.lm_eval, "prompt": self.prompt, "seconds": self.seconds,
                "tasks": {t.name: {"file": t.file, "samples": t.samples, "metrics": t.metrics} for t in self.tasks}}


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4f}"


# ------------------------------------------------------------------------------------------------
# Task files


def task_files(paths: list[Path]) -> list[Path]:
    """Each --tasks: a task YAML, or a folder whose *.yaml files are tasks; one line for what is neither."""
    files: list[Path] = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.yaml") if p.is_file())
            if not found:
                raise EvalError(f"--tasks {path}: no *.yaml task file in this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise EvalError(f"--tasks {path}: no such file or folder")
    return files


def task_config(path: Path) -> dict[str, Any]:
    """The task's config as lm-eval reads it, with relative data_files made relative to the task file."""
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval's loader: `include` and `!function` as it reads them

    try:
        config = load_yaml(path)
    except Exception as exc:  # yaml errors, a missing include or !function module: one line naming the file
        raise EvalError(f"{path}: cannot read the task: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
    if "group" in config and "task" not in config:
        raise EvalError(f"{path}: a group file; pass its task files with --tasks (or their folder)")
    if not isinstance(config.get("task"), str):
        raise EvalError(f"{path}: no `task:` name (an lm-eval task file names its task)")
    kwargs = config.get("dataset_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("data_files") is not None:
        kwargs = dict(kwargs)
        kwargs["data_files"] = _relative_to(kwargs["data_files"], path.parent.resolve(), path)
        config["dataset_kwargs"] = kwargs
    return config


def _relative_to(files: Any, folder: Path, task: Path) -> Any:
    if isinstance(files, dict):
        return {split: _relative_to(value, folder, task) for split, value in files.items()}
    if isinstance(files, list):
        return [_relative_to(value, folder, task) for value in files]
    if not isinstance(files, str):
        raise EvalError(f"{task}: dataset_kwargs.data_files must be a path, a list or a split -> path mapping")
    if "://" in files:
        raise EvalError(f"{task}: dataset_kwargs.data_files {files}: a URL; finetune eval reads local files only")
    path = Path(files).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        raise EvalError(f"{task}: dataset_kwargs.data_files: {path} does not exist")
    return str(path)


@contextmanager
def offline() -> Iterator[None]:
    """No request to the hub while the tasks load and run: the environment variables for what is imported later,
    and the flags of datasets and huggingface_hub where they were read at import already."""
    import sys

    names = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    saved_env = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    flags = [("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
             ("datasets.config", "HF_DATASETS_OFFLINE")]
    saved = []
    for module_name, attr in flags:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, True)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ------------------------------------------------------------------------------------------------
# The model as lm-eval sees it


def prompted_lm(chat, batch_size: int):
    """lm-eval's HFLM over the loaded model whose chat-template hook is `finetune chat`'s prompt (module doc)."""
    from lm_eval.models.huggingface import HFLM

    from finetune.use.conversation import Conversation

    _quiet()

    class TrainedPromptLM(HFLM):
        def __init__(self):
            super().__init__(pretrained=chat.model, tokenizer=chat.tokenizer, batch_size=batch_size,
                             add_bos_token=False)
            self.fmt = chat.fmt
            self.prompts: dict[str, tuple[list[int], Optional[str]]] = {}  # context text -> (ids, source text)

        def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
            if not add_generation_prompt:
                raise EvalError("a task with gen_prefix starts the reply itself; finetune prompts exactly as the run "
                                "trained (remove gen_prefix)")
            conversation = Conversation(self.tokenizer, self.fmt)
            *earlier, last = chat_history
            if any(m["role"] == "system" for m in chat_history):
                raise EvalError("a task with a description or system instruction adds a system turn, which the "
                                "run's prompt (as finetune chat builds it) has none of: remove `description`")
            if last["role"] != "user" or len(earlier) % 2:
                raise EvalError(f"a task's turns must alternate user and assistant and end with the user's "
                                f"({[m['role'] for m in chat_history]})")
            for user, reply in zip(earlier[0::2], earlier[1::2]):
                conversation.add(user["content"], reply["content"], self._response_ids(reply["content"]))
            ids = conversation.prompt_ids(last["content"])
            key = self.tokenizer.decode(ids)
            self.prompts[key] = (ids, conversation.prompt_text(last["content"]))
            return key

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood(requests, disable_tqdm=True)  # the command prints its own lines

        def generate_until(self, requests, disable_tqdm: bool = False):
            return super().generate_until(requests, disable_tqdm=True)

        def chat_template(self, chat_template=False) -> str:
            return ""  # the prompt is finetune chat's, not a template string lm-eval could record

        def _response_ids(self, text: str) -> list[int]:
            """A reply tokenized as training tokenizes a response (finetune.data.tokenize: alone, no specials)."""
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        def _encode_pair(self, context: str, continuation: str):
            if context not in self.prompts:
                return super()._encode_pair(context, continuation)
            ids, text = self.prompts[context]
            if text is not None:  # one text, as training tokenizes a chat or a document; split after the prompt
                adds = Conversation(self.tokenizer, self.fmt).adds_special_tokens
                whole = list(self.tokenizer(text + continuation, add_special_tokens=adds)["input_ids"])
                if whole[:len(ids)] == ids:
                    return list(ids), whole[len(ids):]
            return list(ids), self._response_ids(continuation)

        def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
            if not all(s in self.prompts for s in strings):
                return super().tok_batch_encode(strings, padding_side, left_truncate_len, truncation)
            import torch

            rows = [self.prompts[s][0][-left_truncate_len:] if left_truncate_len else self.prompts[s][0]
                    for s in strings]
            width = max(len(r) for r in rows)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):
                if padding_side == "left":
                    ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
                else:
                    ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
            return ids, mask

    return TrainedPromptLM()


# ------------------------------------------------------------------------------------------------
# Running


def _quiet() -> None:
    """lm-eval's notes on a preloaded model and on bootstrapping say nothing a user acts on: errors only."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


def lm_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        raise EvalError(f"--tasks runs lm-evaluation-harness, which is not installed: {INSTALL_HINT}") from None


def run_tasks(lm, configs: list[dict[str, Any]], limit: Optional[int]) -> dict[str, Any]:
    """lm-eval's simple_evaluate on the loaded configs; {task: {metric: value}} and {task: samples}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _quiet()
    with offline(), contextlib.redirect_stderr(io.StringIO()), _one_line(configs):  # lm-eval's progress bars
        manager = TaskManager(include_defaults=False)  # local task files only: no scan of lm-eval's 10k YAMLs
        return simple_evaluate(model=lm, tasks=[dict(c) for c in configs], task_manager=manager, limit=limit,
                               apply_chat_template=True, fewshot_as_multiturn=True, log_samples=False,
                               bootstrap_iters=1000)


def load_tasks(configs: list[dict[str, Any]]) -> None:
    """Build every task (its data read) before a model loads: a bad task file costs seconds, not a model load."""
    from lm_eval.tasks import TaskManager

    _quiet()
    with offline(), contextlib.redirect_stderr(io.StringIO()), _one_line(configs):
        TaskManager(include_defaults=False).load([dict(c) for c in configs])


@contextmanager
def _one_line(configs: list[dict[str, Any]]) -> Iterator[None]:
    """Whatever lm-eval raises on a task (a missing column, an unknown metric or output_type, unreadable data) as
    one line naming the tasks; finetune's own errors pass through."""
    try:
        yield
    except EvalError:
        raise
    except Exception as exc:  # lm-eval raises many types for a bad task file; the user reads one line
        raise EvalError(f"lm-eval could not run the tasks ({', '.join(c['task'] for c in configs)}): "
                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None


def benchmark(run_dir: Path, tasks: list[Path], device: str = "auto", batch_size: int = 8,
              limit: Optional[int] = None, log: Callable[[str], None] = print) -> BenchmarkResult:
    """Run the task files on the fine-tuned model and on its base; written to RUN/eval.json (`benchmarks`) and
    report.html."""
    from finetune.rundir.errors import RunDirError
    from finetune.rundir.run_dir import RunDir
    from finetune.use.chat import ChatError, load_chat_model, resolve_source

    version = lm_eval_version()
    files = task_files(tasks)
    configs = [task_config(f) for f in files]
    names = [c["task"] for c in configs]
    if len(set(names)) != len(names):
        raise EvalError(f"--tasks: two task files name the same task ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    run_dir = Path(run_dir)
    try:
        recipe = RunDir(run_dir).require().recipe()
    except RunDirError as exc:
        raise EvalError(str(exc)) from None
    if objectives.get(recipe.objective).score_head:
        raise EvalError(f"{run_dir} is a reward model (a score head): lm-eval tasks need a language model")
    started = time.perf_counter()
    load_tasks(configs)
    try:
        source = resolve_source(run_dir)
        log(f"loading {source.label} ...")
        chat = load_chat_model(source, device)
    except ChatError as exc:
        raise EvalError(str(exc)) from None
    log(f"prompt: {chat.fmt} (as finetune chat prompts the run); tasks: {', '.join(names)}"
        + (f" (first {limit} documents each)" if limit else ""))
    lm = prompted_lm(chat, batch_size)
    tuned = run_tasks(lm, configs, limit)
    base = _base_results(chat, source, configs, limit, batch_size)
    scores = [_scores(name, f.name, tuned, base) for name, f in zip(names, files)]
    result = BenchmarkResult(scores, prompt=chat.fmt, lm_eval=version, seconds=time.perf_counter() - started)
    write_benchmarks(run_dir, result)
    return result


def _base_results(chat, source, configs, limit, batch_size) -> dict[str, Any]:
    if source.adapter is not None:
        with chat.model.disable_adapter():
            return run_tasks(prompted_lm(chat, batch_size), configs, limit)
    from finetune.rundir.run_dir import resolve_base
    from finetune.use.chat import ChatModel, Source, load_chat_model

    recipe = source.recipe
    base = load_chat_model(Source(model=resolve_base(recipe), recipe=recipe, fmt=recipe.data.format,
                                  tokenizer=source.tokenizer, label="base"), chat.device)
    return run_tasks(prompted_lm(ChatModel(base.model, chat.tokenizer, chat.fmt, chat.device, "base"), batch_size),
                     configs, limit)


def _scores(name: str, file: str, tuned: dict[str, Any], base: dict[str, Any]) -> TaskScores:
    """{metric: {base, fine_tuned, base_stderr, fine_tuned_stderr}} from lm-eval's `metric,filter` keys."""
    def metrics(out: dict[str, Any]) -> dict[str, Optional[float]]:
        values = {}
        for key, value in (out.get("results") or {}).get(name, {}).items():
            metric, _, _filter = key.partition(",")
            if metric == "alias" or not _:
                continue
            values[metric] = float(value) if isinstance(value, (int, float)) else None
        return values

    got, ref = metrics(tuned), metrics(base)
    out: dict[str, dict[str, Optional[float]]] = {}
    for metric in got:
        if metric.endswith(_STDERR):
            continue
        out[metric] = {"base": ref.get(metric), "fine_tuned": got[metric],
                       "base_stderr": ref.get(metric + _STDERR), "fine_tuned_stderr": got.get(metric + _STDERR)}
    samples = (tuned.get("n-samples") or {}).get(name, {})
    return TaskScores(name, file, int(samples.get("effective") or samples.get("original") or 0), out)


def write_benchmarks(run_dir: Path, result: BenchmarkResult) -> None:
    """eval.json's `benchmarks` section (what the loss eval wrote stays), then report.html again."""
    from finetune.fsutil import write_atomic

    write_record(run_dir / EVAL_FILE, {BENCHMARKS_KEY: result.to_json()})
    from finetune.rundir.names import PLOT_FILE, REPORT_FILE
    from finetune.train.report import render_report

    if (run_dir / REPORT_FILE).is_file():
        write_atomic(run_dir / REPORT_FILE, render_report(run_dir, (run_dir / PLOT_FILE).is_file()))
