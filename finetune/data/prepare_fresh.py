"""finetune.data.prepare.prepare in a fresh process, for a launcher that has already imported torch.

`finetune train`'s launcher imports torch (and what the recipe needs) for its preflight before it tokenizes.
The tokenizing workers are forked from the process that runs `prepare`; forked from the launcher, each one
would carry torch's pages too (shared, but resident in every worker: ~0.3-0.5 GB each in the sum of their RSS).
So the launcher runs `prepare` here, in a new interpreter that imports only datasets and the tokenizer's
class (the tokenizer arrives pickled, as datasets ships it to its workers), and forks the workers from that.
`finetune prepare` needs none of this: it never imports torch (finetune.tokenizer.load_without_torch).

The child dies with the launcher (Linux's parent-death signal: a `kill -9` of `finetune train` while it tokenizes
takes the child and its workers along; finetune.parentdeath).

Protocol: the parent writes a pickle of the arguments to the child's stdin; the child writes JSON lines to
stdout: {"log": line} for each log line, then {"done": Prepared.as_dict()} or {"error": message}.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

from finetune.data.prepare import Prepared, prepare
from finetune.data.spec import DataSpec
from finetune.data.tokenize import DataError
from finetune.parentdeath import die_with_parent


def prepare_in_fresh_process(spec: DataSpec, tokenizer, cache_dir: Path, log: Callable[[str], None] = print,
                             num_proc: Union[str, int, None] = None) -> Prepared:
    """`prepare(spec, tokenizer, cache_dir, log, num_proc)`, run by `python -m finetune.data.prepare_fresh`."""
    import finetune

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(finetune.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p)}
    payload = pickle.dumps({"spec": spec, "tokenizer": tokenizer, "cache_dir": str(cache_dir), "num_proc": num_proc})
    child = subprocess.Popen(child_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(payload)
    child.stdin.close()
    result: dict[str, Any] = {}
    for raw in child.stdout:
        try:
            message = json.loads(raw)
        except ValueError:
            continue  # not ours (the child's libraries write to stderr, but be lenient)
        if "log" in message:
            log(message["log"])
        result.update({k: v for k, v in message.items() if k != "log"})
    code = child.wait()
    if "done" in result and code == 0:
        return Prepared.from_dict(result["done"])
    # A killed child has cleaned nothing up: its `.partial` folder names its pid, and the next prepare removes it.
    raise DataError(result.get("error") or f"tokenizing failed in its process (exit code {code}); nothing was cached")


def child_argv() -> list[str]:
    """The child's command line: it is told who its parent is, to die with it."""
    return [sys.executable, "-m", "finetune.data.prepare_fresh", str(os.getpid())]


def _child(parent: int) -> int:
    # A SIGKILLed launcher takes this process along (and its workers: prepare() ties them to it). Without it the
    # child tokenized on at full CPU, published the entry, then wrote into the dead launcher's pipe (issue 34).
    die_with_parent(signal.SIGKILL, parent)
    out = sys.stdout
    sys.stdout = sys.stderr  # only our JSON lines on stdout

    def say(**message: Any) -> None:
        try:
            out.write(json.dumps(message) + "\n")
            out.flush()
        except BrokenPipeError:  # the launcher is gone (where no parent-death signal exists): nobody to tell
            os._exit(1)

    args = _read_arguments()
    if args is None:
        say(error="the tokenizing process received no arguments from finetune (its launcher broke off)")
        return 1
    try:
        done = prepare(args["spec"], args["tokenizer"], Path(args["cache_dir"]), log=lambda line: say(log=line),
                       num_proc=args["num_proc"])
    except DataError as exc:
        say(error=str(exc))
        return 1
    except OSError as exc:
        say(error=f"cannot write the tokenized data under {args['cache_dir']}: {exc.strerror or exc}")
        return 1
    say(done=done.as_dict())
    return 0


def _read_arguments() -> Optional[dict[str, Any]]:
    """The parent's pickle, or None where it broke off. A parent killed while the child starts closes the pipe
    (the kernel closes a dying process's files) a moment before it sends the parent-death signal, so a short
    read is usually that: wait for the signal instead of printing an EOFError nobody asked for."""
    try:
        return pickle.loads(sys.stdin.buffer.read())
    except (EOFError, pickle.UnpicklingError):
        time.sleep(2)  # the parent-death SIGKILL ends this process here when the launcher is gone
        return None


if __name__ == "__main__":
    sys.exit(_child(int(sys.argv[1])))
