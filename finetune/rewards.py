"""GRPO's reward functions (recipe `grpo.rewards`): the built-ins, your own by import path, and the checks
that catch a bad one before launch. No torch here: lint reads the syntax, preflight imports and calls.

The contract (TRL's GRPOTrainer calls every reward once per generated batch):

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]

- `prompts`, `completions`: one entry per completion (a prompt repeats num_generations times); text, or
  for chat data a list of {role, content} messages (the completion is `[{"role": "assistant", ...}]`);
- `completion_ids`: the generated token ids of each completion;
- `kwargs`: every other dataset column, one value per completion (e.g. `answer`), plus TRL's
  `trainer_state`, `log_extra` and `log_metric`; accept `**kwargs` so new ones do not break you;
- return one float per completion (None: not applicable to this completion; TRL ignores it).

The rewards are summed with their `weight`; GRPO turns the sum into advantages within each group.
A function is named `module:function` (importable) or `path/to/file.py:function` (relative to the recipe).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from finetune.errors import FinetuneError
from finetune.fsutil import SpecialFile, refuse_special

BUILTINS = ("exact_match", "number_match", "regex", "length", "think_format")
_PATH_RE = re.compile(r"^(?P<module>[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*|[^:]+\.py):(?P<function>[A-Za-z_]\w*)$")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_THINK_RE = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)


class RewardError(FinetuneError):
    """A reward function that cannot be used: one line naming the function."""


# ------------------------------------------------------------------------------------------------
# Syntax (lint: no imports)


def syntax_problem(function: str) -> Optional[str]:
    """Why `function` is neither a built-in nor `module:function` / `file.py:function`, or None."""
    if function in BUILTINS:
        return None
    if ":" not in function:
        from finetune.suggest import closest

        guess = closest(function, BUILTINS)
        return (f"`{function}` is not a built-in reward ({', '.join(BUILTINS)})"
                + (f"; did you mean `{guess}`?" if guess else "; give your own as `package.module:function`"))
    if not _PATH_RE.match(function):
        return f"`{function}` is not `package.module:function` or `file.py:function`"
    return None


def is_builtin(function: str) -> bool:
    return function in BUILTINS


# ------------------------------------------------------------------------------------------------
# Built-ins


def text_of(completion: Any) -> str:
    """A completion as text: chat completions are a list of messages (their contents joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(m.get("content") or "" for m in completion if isinstance(m, dict) and isinstance(m.get("content"), str))
    return str(completion)


def normalise(text: Any) -> str:
    """Case, surrounding whitespace and punctuation, inner runs of whitespace: what exact_match ignores."""
    return " ".join(str(text).strip().strip(".!?;:'\"`").lower().split())


def final_number(text: Any) -> Optional[float]:
    """The last number in the text (GSM8K's `#### 42`, `\\boxed{42}`, `the answer is 1,234.`), or None."""
    found = _NUMBER_RE.findall(str(text))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _column(kwargs: dict, column: str, n: int, name: str) -> list:
    values = kwargs.get(column)
    if values is None:
        raise RewardError(f"reward {name}: the data has no `{column}` column (set the reward's `column`)")
    return list(values)[:n]


def exact_match(column: str = "answer") -> Callable:
    def reward(prompts, completions, **kwargs):
        answers = _column(kwargs, column, len(completions), "exact_match")
        return [1.0 if normalise(text_of(c)) == normalise(a) else 0.0 for c, a in zip(completions, answers)]
    return reward


def number_match(column: str = "answer") -> Callable:
    def reward(prompts, completions, **kwargs):
        answers = _column(kwargs, column, len(completions), "number_match")
        out = []
        for completion, answer in zip(completions, answers):
            got, want = final_number(text_of(completion)), final_number(answer)
            out.append(None if want is None else float(got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)))
        return out
    return reward


def regex(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts, completions, **kwargs):
        return [1.0 if compiled.search(text_of(c)) else 0.0 for c in completions]
    return reward


def length(target: int) -> Callable:
    def reward(prompts, completions, completion_ids=None, **kwargs):
        sizes = [len(ids) for ids in completion_ids] if completion_ids is not None else [len(text_of(c)) for c in completions]
        return [-abs(size - target) / target for size in sizes]
    return reward


def think_format() -> Callable:
    def reward(prompts, completions, **kwargs):
        return [1.0 if _THINK_RE.match(text_of(c)) else 0.0 for c in completions]
    return reward


def builtin(spec: Any) -> Callable:
    """The built-in reward a recipe's `grpo.rewards` entry names, with its settings."""
    name = spec.function
    if name == "exact_match":
        return exact_match(spec.column)
    if name == "number_match":
        return number_match(spec.column)
    if name == "regex":
        return regex(spec.pattern)
    if name == "length":
        return length(spec.target)
    return think_format()


# ------------------------------------------------------------------------------------------------
# Your own: import, then one call on a real row


def load_user(function: str) -> Callable:
    """Imports `module:function` or `file.py:function` (an absolute path after recipe loading)."""
    module_name, _, attr = function.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            refuse_special(path, f"reward {function}")  # importing a FIFO waits for a writer forever
            if not path.is_file():
                raise RewardError(f"reward {function}: no file {path}")
            unique = f"finetune_reward_{abs(hash(str(path.resolve())))}"
            module = sys.modules.get(unique)
            if module is None:
                spec = importlib.util.spec_from_file_location(unique, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[unique] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except SpecialFile as exc:
        raise RewardError(str(exc)) from None
    except RewardError:
        raise
    except ModuleNotFoundError as exc:
        raise RewardError(f"reward {function}: cannot import module `{module_name}` ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing: name it
        raise RewardError(f"reward {function}: importing `{module_name}` raised {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward {function}: module `{module_name}` has no function `{attr}`")
    if not callable(fn):
        raise RewardError(f"reward {function}: `{attr}` is a {type(fn).__name__}, not a function")
    return fn


def named(fn: Callable, name: str) -> Callable:
    """`fn` under the name TRL logs it as (`rewards/<name>/mean`)."""
    def reward(*args, **kwargs):
        return fn(*args, **kwargs)
    reward.__name__ = name
    return reward


def reward_names(specs: list) -> list[str]:
    """One unique metric name per reward: the built-in's or function's name, numbered on repeats."""
    names: list[str] = []
    for spec in specs:
        base = spec.function.rpartition(":")[2]
        name, n = base, 2
        while name in names:
            name, n = f"{base}_{n}", n + 1
        names.append(name)
    return names


def check_call(fn: Callable, function: str, prompts: list, completions: list, completion_ids: list,
               columns: dict[str, list]) -> None:
    """Calls `fn` the way TRL does, on one real row repeated for each completion; raises RewardError."""
    kwargs = {**columns, "trainer_state": None, "log_extra": lambda *a, **k: None, "log_metric": lambda *a, **k: None}
    try:
        inspect.signature(fn).bind(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    except TypeError as exc:
        raise RewardError(f"reward {function}: wrong signature ({exc}); write "
                          "`def f(prompts, completions, **kwargs)` returning one float per completion") from None
    except ValueError:  # a builtin without a signature: the call below tells
        pass
    try:
        out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    except SpecialFile as exc:
        raise RewardError(str(exc)) from None
    except RewardError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's function raised on a real row: name it
        raise RewardError(f"reward {function}: raised {type(exc).__name__} on the first data row: {exc}") from None
    if not isinstance(out, (list, tuple)):
        raise RewardError(f"reward {function}: returned {type(out).__name__}, expected a list of floats "
                          f"(one per completion)")
    if len(out) != len(completions):
        raise RewardError(f"reward {function}: returned {len(out)} value(s) for {len(completions)} completions "
                          "(one float per completion)")
    for value in out:
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise RewardError(f"reward {function}: returned a {type(value).__name__} ({value!r:.40}), expected "
                              "a float (or None) per completion")


# ------------------------------------------------------------------------------------------------
# Before launch (finetune.run.preflight)


def preflight(recipe: Any) -> tuple[list[str], list[str]]:
    """(notes, errors): every reward built (user functions imported) and called on the data's first row."""
    errors: list[str] = []  # grpo.vllm is the environment's question: finetune.run.doctor.vllm_checks
    functions = []
    for spec in recipe.grpo.rewards:
        try:
            functions.append((spec.function, builtin(spec) if is_builtin(spec.function) else load_user(spec.function)))
        except RewardError as exc:
            errors.append(str(exc))
    if errors or not functions:
        return [], errors
    row = first_row(recipe)
    if row is None:
        return ["rewards: imported; not called (the data is not local, or has no readable row)"], []
    prompt = row["prompt"]
    answer = row.get("answer")
    # Two completions of the row's prompt: its reference answer (when it has one) and an empty one.
    texts = [answer if isinstance(answer, str) else "42", ""]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if isinstance(prompt, list) else texts
    columns = {k: [v] * len(texts) for k, v in row.items() if k != "prompt"}
    for function, fn in functions:
        try:
            check_call(fn, function, [prompt] * len(texts), completions, [[1, 2, 3], []], columns)
        except RewardError as exc:
            errors.append(str(exc))
    if errors:
        return [], errors
    return [f"rewards: {', '.join(f for f, _ in functions)} called on the first data row, each returns one float per completion"], []


def first_row(recipe: Any) -> Optional[dict[str, Any]]:
    """The first row of the first local source, as GRPO reads it (finetune.data.preference), or None."""
    from finetune.data import validate
    from finetune.data.formats import RowProblem, to_example
    from finetune.data.sources import SourceProblem, data_files, sources_of
    from finetune.recipe.references import is_local

    for source in sources_of(recipe.data, recipe.objective):
        if not is_local(source.path):
            continue
        try:
            for file in data_files(Path(source.path).expanduser(), source.split):
                for _, row in validate.iter_rows(file):
                    if isinstance(row, dict):
                        try:
                            return to_example(row, source.spec).values
                        except RowProblem:
                            continue
        except (SourceProblem, validate.Unreadable):
            continue
    return None
