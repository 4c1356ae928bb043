"""Mutate every shipped recipe at every key and time `lint`, `render` and `plan` on each mutant (issue 40 item 4).

    python scripts/fuzz_recipes.py                       # every mutant of recipes/**/*.yaml, in this process
    python scripts/fuzz_recipes.py --limit 2 --slow 0.5  # stop a command after 2 s; list those over 0.5 s
    python scripts/fuzz_recipes.py --cli                 # the same through the real CLI (one subprocess each; slow)

Mutants of each recipe: every key (at every depth, sections themselves included) given each value of VALUES
(wrong types, huge and non-finite numbers, long strings, deep nesting); and text mutants: an alias bomb
("billion laughs"), a duplicate key, 100,000 nested brackets, a 1 MiB line. A command that raises anything but
finetune's own errors, or runs past --limit (SIGALRM), is printed with the mutant; the slowest are listed at the
end. Exit 1 when any mutant crashed or ran past the limit.

Not run by the tests: its 51,168 invocations take tens of minutes; tests/lint/test_fuzz.py and tests/cli/test_fuzz.py
draw mutants of the same kinds (hypothesis), and tests/cli/test_special_inputs.py holds the text mutants' cases.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
DEEP = 50  # levels of the nested value: within the loader's limit (64), so the schema and the rules see it

VALUES: list[Any] = [8, -1, 0, 2**70, float("inf"), float("nan"), 1e-300, True, None, "", "x" * 10_000, "../../x",
                     "/dev/zero", [], [1, "a"], {}, {"a": 1}, {"path": 8}, [[[[[[]]]]]],
                     json.loads("[" * DEEP + "]" * DEEP)]

BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x, x]"] +
                 [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)])


def yaml_value(value: Any) -> str:
    """`value` as one line of flow YAML (JSON, with YAML's spelling of the non-finite floats)."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def dump(data: Any, indent: str = "") -> str:
    """Block YAML for a mapping whose leaves are flow values."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{json.dumps(key)}:")
            lines.append(dump(value, indent + "  "))
        else:
            lines.append(f"{indent}{json.dumps(key)}: {yaml_value(value)}")
    return "\n".join(lines)


def key_paths(data: Any, prefix: tuple = ()) -> Iterator[tuple]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield prefix + (key,)
            yield from key_paths(value, prefix + (key,))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield prefix + (index,)
            yield from key_paths(value, prefix + (index,))


def replaced(data: Any, path: tuple, value: Any) -> Any:
    copy = json.loads(json.dumps(data))
    node = copy
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return copy


def mutants(recipe: Path) -> Iterator[tuple[str, str]]:
    """(label, text) of every mutant of `recipe`."""
    from finetune.recipe.yamlio import load_yaml

    text = recipe.read_text(encoding="utf-8")
    data = load_yaml(text).data
    for path in key_paths(data):
        for value in VALUES:
            yield f"{'.'.join(map(str, path))}={yaml_value(value)[:40]}", dump(replaced(data, path, value))
    for section in ("model", "data", "training", "deepspeed", "grpo", "preference", "launch", "hardware", "lora"):
        for value in VALUES:
            yield f"{section}={yaml_value(value)[:40]}", dump({**data, section: value})
    yield "alias bomb", text + "\n" + BOMB + "\n"
    yield "duplicate key", text + "\nmethod: lora\nmethod: full\n"
    yield "100k brackets", text + "\nx: " + "[" * 100_000 + "]" * 100_000 + "\n"
    yield "1 MiB line", text + "\nname: " + "a" * 2**20 + "\n"


class TooLong(Exception):
    pass


def _alarm(signum, frame):
    raise TooLong()


def in_process(path: Path, limit: float) -> list[tuple[str, float, str]]:
    """(command, seconds, problem or "") for lint, render and plan of the recipe at `path`."""
    from finetune.errors import FinetuneError
    from finetune.lint import LintOptions, lint_paths
    from finetune.plan import plan_recipe
    from finetune.recipe import RecipeProblem, load_recipe
    from finetune.render import render_deepspeed, render_training_args

    def lint():
        lint_paths([path], LintOptions(world_size=2))

    def render():
        recipe = load_recipe(path).recipe
        render_deepspeed(recipe, recipe.world_size)
        render_training_args(recipe)

    def plan():
        plan_recipe(load_recipe(path).recipe, gpus=2, gpu_memory_bytes=24 * 2**30)

    out = []
    for name, command in (("lint", lint), ("render", render), ("plan", plan)):
        started = time.perf_counter()
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        problem = ""
        try:
            try:
                command()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except (RecipeProblem, FinetuneError):
            pass
        except TooLong:
            problem = f"ran past {limit:g} s"
        except Exception as exc:  # noqa: BLE001 - what the fuzzer looks for
            problem = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        out.append((name, time.perf_counter() - started, problem))
    return out


def through_cli(path: Path, limit: float) -> list[tuple[str, float, str]]:
    out = []
    for name in ("lint", "render", "plan"):
        started = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "finetune", name, str(path)], capture_output=True, text=True,
                                  timeout=limit, cwd=REPO)
            bad = done.returncode not in (0, 1, 2, 3) or "Traceback" in done.stderr
            problem = f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}" if bad else ""
        except subprocess.TimeoutExpired:
            problem = f"ran past {limit:g} s"
        out.append((name, time.perf_counter() - started, problem))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=10.0, help="seconds one command may take")
    parser.add_argument("--slow", type=float, default=1.0, help="list the mutants slower than this")
    parser.add_argument("--cli", action="store_true", help="through the real CLI, one subprocess per command")
    parser.add_argument("--only", default="", help="only recipes whose path contains this")
    parser.add_argument("--verbose", action="store_true", help="print each mutant before running it")
    args = parser.parse_args()
    run = through_cli if args.cli else in_process
    recipes = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if args.only in str(p))
    failures, slow, count = [], [], 0
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "recipes"  # mutants sit in a copy of recipes/: relative paths and extends hold
        shutil.copytree(REPO / "recipes", copy)
        for recipe in recipes:
            path = copy / recipe.relative_to(REPO / "recipes").parent / f"mutant{recipe.suffix}"
            for label, text in mutants(recipe):
                path.write_text(text, encoding="utf-8")
                if args.verbose:
                    print(f"{recipe.relative_to(REPO)} [{label}]", flush=True)
                for command, seconds, problem in run(path, args.limit):
                    count += 1
                    where = f"{recipe.relative_to(REPO)} [{label}] {command}"
                    if problem:
                        failures.append(f"{where}: {problem}")
                        print(f"FAIL {where}: {problem}", flush=True)
                    if seconds > args.slow:
                        slow.append((seconds, where))
    slow.sort(reverse=True)
    print(f"{count} invocations, {len(failures)} failed, {len(slow)} over {args.slow:g} s")
    for seconds, where in slow[:20]:
        print(f"  {seconds:6.2f} s  {where}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
