"""What a launch came to: which rank failed first and why, from torchrun's error files and report; rank logs.

A failing rank is named from the error files torchrun gives every rank (error.json, written by the
runner's @record), with exit codes and hosts from torchrun's printed failure report, which alone
serves when there are no error files. DeepSpeed's launcher names no rank: the rank logs with a
traceback do.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from finetune.run.launch.commands import LaunchPlan
from finetune.rundir.names import AUTO_FILE, LAUNCHER_ERROR_FILE, LOGS_DIR



@dataclass
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int
    error_file: Optional[str] = None
    message: Optional[str] = None
    host: Optional[str] = None

    def describe(self) -> str:
        if self.exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-self.exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-self.exitcode}"
            if self.message:  # its error file: it raised first, and torchrun stopped it while it was exiting
                how = f"raised, then {how} while exiting"
        else:
            how = f"exited with code {self.exitcode}"
        where = f" on {self.host}" if self.host else ""
        return f"rank {self.rank} (local rank {self.local_rank}){where} {how}"


@dataclass
class Outcome:
    returncode: int  # what `finetune train` exits with
    failures: list[RankFailure] = field(default_factory=list)  # root cause first
    signal: Optional[int] = None  # a signal we forwarded
    message: str = ""
    logs: list[Path] = field(default_factory=list)  # log files of the failed ranks
    port_in_use: Optional[int] = None  # the launcher could not bind the rendezvous port; nothing started

    @property
    def ok(self) -> bool:
        return self.returncode == 0



# ----------------------------------------------------------------------------------------------
# Reports


_ROOT_CAUSE = "Root Cause (first observed failure):"
_FAILURE_RE = re.compile(
    r"(?:host\s*:\s*(?P<host>\S+)[^\n]*\n\s*)?"
    r"rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)[^\n]*\n"
    r"\s*error_file\s*:\s*(?P<file>[^\n]*)")


def parse_torchrun_failures(text: str) -> list[RankFailure]:
    """Failed ranks from torchrun's ChildFailedError report, root cause first.

    The report (torch/distributed/elastic/multiprocessing/errors) lists `rank : 1 (local_rank: 1)`,
    `exitcode : 3 (pid: ...)` and `error_file` for each failure under "Failures:", and the first
    observed one under "Root Cause". Ranks SIGTERMed by torchrun after the root cause are listed too.
    """
    if _ROOT_CAUSE not in text:
        return []
    before, _, root = text.rpartition(_ROOT_CAUSE)
    others = before[before.rfind("Failures:"):] if "Failures:" in before else ""
    failures = []
    for block in (root, others):
        for match in _FAILURE_RE.finditer(block):
            error_file = match.group("file").strip()
            failures.append(RankFailure(int(match.group("rank")), int(match.group("local")), int(match.group("code")),
                                        None if error_file in ("", "<N/A>") else error_file, host=match.group("host")))
    return failures


def judge(plan: LaunchPlan, returncode: int, output: str, forwarded: Optional[int],
          started_at: Optional[float] = None) -> Outcome:
    """`started_at`: when this launch began (time.time()); a summary.json written since then is a finished run."""
    from finetune.rundir.checkpoint import EXIT_PREEMPTED, disk_full_in, latest_complete, read_stop_record

    if returncode == 0:
        return Outcome(0, message="all ranks finished")
    if forwarded is not None and finished_since(plan.run_dir, started_at):
        # The signal came during the last step or while the outputs were written: the ranks wrote them and exited
        # 0, while the launcher, signalled too, reports its own stop (issue 34).
        name = "SIGHUP" if forwarded == signal.SIGHUP else signal.Signals(forwarded).name
        return Outcome(0, signal=forwarded, message=f"{name} came after the last step: the run had finished "
                                                    "and its outputs are complete")
    stopped = read_stop_record(plan.run_dir)  # written by the ranks once the checkpoint is complete
    if stopped is not None:
        # The ranks saw SIGTERM when we were sent SIGHUP (_as_stop): name what the user's side sent.
        name = "SIGHUP" if forwarded == signal.SIGHUP else stopped.get("signal")
        return Outcome(EXIT_PREEMPTED, signal=forwarded,
                       message=f"{name} at step {stopped.get('step')}: "
                               f"{stopped.get('checkpoint')} is complete; run the same command again to resume")
    if forwarded is not None:
        name = signal.Signals(forwarded).name
        latest = latest_complete(plan.run_dir)
        saved = f"the newest complete checkpoint is {latest.name}" if latest else "no checkpoint was saved"
        return Outcome(128 + forwarded, signal=forwarded, message=f"stopped by {name} (forwarded to all ranks); {saved}")
    launcher_error = read_error_file(plan.run_dir / LOGS_DIR / LAUNCHER_ERROR_FILE) if plan.launcher == "torchrun" else None
    busy = port_in_use(launcher_error or "", plan.master_port) or port_in_use(output, plan.master_port)
    if busy is not None:
        return Outcome(1, port_in_use=busy,
                       message=f"the rendezvous port {busy} on {plan.master_addr} is in use (another run?); "
                               f"nothing was started. Pass --master-port with a free port")
    failures = torchrun_failures(plan, output) if plan.launcher == "torchrun" else []
    full = disk_full_in(output + "\n" + (launcher_error or ""), plan.run_dir)
    if full and not (failures and failures[0].message and "no space left" in failures[0].message):
        return Outcome(1, failures=failures, message=full)  # the cause is known: no rank log tails
    if failures:
        root = failures[0]
        logs = rank_log_files(plan, root.local_rank)
        message = f"{root.describe()}"
        if root.message:
            message += f": {root.message}"
        return Outcome(1, failures=failures, message=message, logs=logs)
    if plan.launcher == "deepspeed":
        return _judge_deepspeed(plan, returncode, output)
    if launcher_error:
        return Outcome(returncode if returncode > 0 else 1, message=f"{plan.launcher} failed: {launcher_error}")
    return Outcome(returncode if returncode > 0 else 1,
                   message=f"{plan.launcher} exited with code {returncode} (see {plan.run_dir / 'logs' / 'launcher.log'})")


# torch's caching allocator (torch.OutOfMemoryError: "CUDA out of memory. Tried to allocate ..."), a CUDA call that
# allocates outside it ("CUDA error: out of memory"), and cuBLAS when it cannot get its workspace
_OUT_OF_MEMORY_RE = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED")
_CAPACITY_RE = re.compile(r"total capacity of (\d+(?:\.\d+)?) GiB")


def out_of_gpu_memory(outcome: Outcome) -> Optional[str]:
    """The line saying a failed rank ran out of GPU memory (its message, else its log's last lines), or None."""
    for text in [outcome.message] + [_read_tail(log, 40) for log in outcome.logs]:
        for line in text.splitlines():
            if _OUT_OF_MEMORY_RE.search(line):
                return line.strip()
    return None


@dataclass
class MemorySafeRerun:
    """The same run again with the memory-safe values of what `auto` decided for speed, after a rank ran out of GPU
    memory (finetune.plan.auto.memory_safe_values)."""

    chose: str  # what auto had decided for speed: "training.gradient_checkpointing = false, ..."
    sets: list[str]  # --set values: every memory key auto decided, pinned to its memory-safe value
    overwrite: bool  # no checkpoint was saved: the run directory this run wrote is replaced
    force_resume: bool  # a checkpoint was saved and the micro batch changes (the rows per step stay the same)
    then: str  # what the run directory does then

    @property
    def flags(self) -> str:
        return " ".join((["--overwrite"] if self.overwrite else []) + (["--force-resume"] if self.force_resume else [])
                        + [f"--set {value}" for value in self.sets])


def memory_safe_rerun(outcome: Outcome, run_dir: Path, resolution) -> Optional[MemorySafeRerun]:
    """The rerun after a rank ran out of GPU memory where `auto` bet on the plan's bound; None for any other failure,
    and where the memory keys were the recipe's or already memory-safe."""
    return _rerun(run_dir, resolution) if out_of_gpu_memory(outcome) else None


def _rerun(run_dir: Path, resolution) -> Optional[MemorySafeRerun]:
    """memory_safe_rerun once the failure is known to be out of GPU memory."""
    from finetune.plan.auto import MICRO, memory_safe_values
    from finetune.rundir.checkpoint import latest_complete

    safe = memory_safe_values(resolution) if resolution is not None else {}
    if not safe:
        return None
    decided = resolution.values()
    chose = ", ".join(f"{key} = {json.dumps(decided[key])}" for key in safe if decided[key] != safe[key])
    sets = [f"{key}={json.dumps(value) if isinstance(value, bool) else value}" for key, value in safe.items()]
    latest = latest_complete(run_dir)
    if latest is None:
        return MemorySafeRerun(chose, sets, True, False, "it starts again (no checkpoint was saved)")
    if decided.get(MICRO, 1) != 1:
        return MemorySafeRerun(chose, sets, False, True,
                               f"it resumes from {latest.name}, the rows per optimizer step unchanged")
    return MemorySafeRerun(chose, sets, False, False, f"it resumes from {latest.name}")


def rerun_notes(rerun: MemorySafeRerun, run_dir: Path) -> list[str]:
    """What `finetune train` says as it runs `rerun` itself: what `auto` chose for speed, and the values it trains
    with now."""
    return [_what_auto_chose(rerun, run_dir), f"training again with the memory-safe values, as the same command with "
                                              f"{rerun.flags} would; {rerun.then}"]


def out_of_memory_advice(outcome: Outcome, run_dir: Path, resolution) -> list[str]:
    """What to say after a rank ran out of GPU memory ([] for any other failure): what `auto` chose for speed and the
    command that reruns with the memory-safe values, and the planner's search for what fits."""
    from finetune.rundir.names import RECIPE_FILE

    line = out_of_gpu_memory(outcome)
    if line is None:
        return []
    capacity = _CAPACITY_RE.search(line)
    plan = (f"`finetune plan {Path(run_dir) / RECIPE_FILE} --gpu-memory {capacity.group(1) + 'GiB' if capacity else 'SIZE'} "
            "--recommend`")
    rerun = _rerun(run_dir, resolution)
    if rerun is None:
        return [f"a rank ran out of GPU memory with memory settings `auto` did not choose for speed; {plan} lists "
                "setups that fit: ZeRO stage, offload, micro batch, checkpointing"]
    return [_what_auto_chose(rerun, run_dir),
            f"the same command with {rerun.flags} runs with the memory-safe values; {rerun.then}",
            f"{plan} shows what each setting needs"]


def _what_auto_chose(rerun: MemorySafeRerun, run_dir: Path) -> str:
    return (f"a rank ran out of GPU memory where `auto` chose {rerun.chose} for speed under the plan's bound (the "
            f"reasons: {Path(run_dir) / AUTO_FILE})")


def finished_since(run_dir: Path, started_at: Optional[float]) -> bool:
    """Whether the ranks wrote the run's summary.json (their last output but the report) since `started_at`."""
    from finetune.rundir.names import SUMMARY_FILE

    if started_at is None:
        return False
    try:
        return (Path(run_dir) / SUMMARY_FILE).stat().st_mtime >= started_at
    except OSError:
        return False


_PORT_IN_USE_RE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
_PORT_RE = re.compile(r"port:?\s*(\d+)")


def port_in_use(text: str, default: int) -> Optional[int]:
    """The port named in a bind failure (torch's DistNetworkError: "port: 29500, ... EADDRINUSE"), or None."""
    for line in text.splitlines():
        if _PORT_IN_USE_RE.search(line):
            match = _PORT_RE.search(line)
            return int(match.group(1)) if match else default
    return None


def read_error_file(path: Path) -> Optional[str]:
    """The last line of the exception in a torchrun error file (written by torch's @record), or None."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    message = data.get("message", {}) if isinstance(data, dict) else None
    text = message.get("message") if isinstance(message, dict) else message
    if not isinstance(text, str) or not text.strip():
        return None
    return text.strip().splitlines()[-1]


def _error_file_time(path: Path) -> float:
    """When the rank raised (error.json's timestamp, else the file's mtime): the first one is the root cause."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return float(data["message"]["extraInfo"]["timestamp"])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return path.stat().st_mtime
        except OSError:
            return float("inf")


def torchrun_failures(plan: LaunchPlan, output: str) -> list[RankFailure]:
    """Failed ranks, root cause first: from the error files torchrun gives every rank
    (attempt_N/<local rank>/error.json, written by the runner's @record), exit codes and hosts from
    torchrun's printed report. Ranks that died without an error file (a signal, os._exit) come only
    from the printed report."""
    printed = {f.local_rank: f for f in parse_torchrun_failures(output)}
    attempt = torchrun_attempt_dir(plan.run_dir)
    files = sorted(attempt.glob("*/error.json"), key=_error_file_time) if attempt else []
    failures = []
    for path in files:
        local = int(path.parent.name) if path.parent.name.isdigit() else None
        message = read_error_file(path)
        if local is None or message is None:
            continue
        seen = printed.pop(local, None)
        failures.append(RankFailure(plan.node_rank * plan.procs_per_node + local, local,
                                    seen.exitcode if seen else 1, str(path), message,
                                    host=seen.host if seen else socket.gethostname()))
    rest = parse_torchrun_failures(output)  # in the report's order: root cause first
    failures += [f for f in rest if f.local_rank in printed]
    for failure in failures:
        if failure.message is None and failure.error_file:
            failure.message = read_error_file(Path(failure.error_file))
        if failure.message is None and attempt is not None:
            failure.message = _own_error_line(attempt / str(failure.local_rank) / "stderr.log")
    return sorted(failures, key=_consequence)


def _own_error_line(log: Path) -> Optional[str]:
    """The one line a rank printed before exiting 1 without an exception (finetune.train.preemption.exit_code_for:
    a full disk, a checkpoint problem): "error: rank N on HOST: MESSAGE" -> MESSAGE."""
    for line in reversed(_read_tail(log, 50).splitlines()):
        match = re.match(r"(?:\[rank\d+\]:\s*)?error: rank \d+ on \S+: (.+)", line.strip())
        if match:
            return match.group(1)
    return None  # stable: time order within each kind


# A rank whose peer died fails in its next collective with one of these (gloo: "Connection reset by peer" /
# "Connection closed by peer"; NCCL: "remote process exited", a watchdog timeout). Its error file can be
# older than the dead peer's report (torchrun only notices the exit later, and a SIGKILLed rank writes no
# error file), so it is the consequence, never the cause, when another rank failed on its own.
_PEER_FAILED = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exit|DistBackendError|"
                          r"DistNetworkError|ProcessGroup\w* .*(timed out|Timeout)|Watchdog caught collective|"
                          r"NCCL communicator was aborted|recvBytes|Socket Timeout", re.IGNORECASE)


def _consequence(failure: RankFailure) -> int:
    """0: failed on its own (its own exception, or killed by anything but torchrun's SIGTERM, or exited
    without a word); 1: failed because a peer did; 2: stopped by torchrun (SIGTERM) after the first failure."""
    if failure.message is not None:
        return 1 if _PEER_FAILED.search(failure.message) else 0
    return 2 if failure.exitcode == -signal.SIGTERM else 0


def _judge_deepspeed(plan: LaunchPlan, returncode: int, output: str) -> Outcome:
    # DeepSpeed's launcher reports only "exits with return code = N", not which rank. A Python
    # failure leaves a traceback in that rank's log; the ranks it then kills end without one.
    code = re.findall(r"exits with return code = (-?\d+)", output)
    exitcode = int(code[-1]) if code else returncode
    failures, logs = [], []
    for path in sorted((plan.run_dir / LOGS_DIR).glob("*_rank*.log")):
        match = re.search(r"_rank(\d+)\.log$", path.name)
        if match and "Traceback (most recent call last)" in _read_tail(path, 200):
            rank = int(match.group(1))
            # Rank logs under this run directory come from this machine's launch (other nodes write theirs).
            host = socket.gethostname() if not plan.hosts or len(plan.hosts) == 1 else None
            failures.append(RankFailure(rank, rank % max(plan.procs_per_node, 1), exitcode, host=host))
            logs.append(path)
    if failures:
        return Outcome(1, failures=failures, message=failures[0].describe(), logs=logs)
    return Outcome(1, message=f"a rank exited with code {exitcode}; DeepSpeed's launcher does not say which "
                              f"(per-rank logs: {plan.run_dir / 'logs'})")


def _read_tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 256 * lines))
            return b"\n".join(handle.read().splitlines()[-lines:]).decode("utf-8", "replace")
    except OSError:
        return ""


def tail_of(path: Path, lines: int = 20) -> str:
    return _read_tail(path, lines)


# ----------------------------------------------------------------------------------------------
# Per-rank logs


def torchrun_attempt_dir(run_dir: Path) -> Optional[Path]:
    """torchrun writes RUN/logs/torchrun/<run id>_<random>/attempt_<n>/<local rank>/; the newest attempt."""
    attempts = sorted((run_dir / LOGS_DIR / "torchrun").glob("*/attempt_*"), key=lambda p: p.stat().st_mtime)
    return attempts[-1] if attempts else None


def rank_log_files(plan: LaunchPlan, local_rank: int) -> list[Path]:
    if plan.launcher == "torchrun":
        attempt = torchrun_attempt_dir(plan.run_dir)
        if attempt is None:
            return []
        return [p for p in (attempt / str(local_rank) / "stderr.log", attempt / str(local_rank) / "stdout.log") if p.exists()]
    rank = plan.node_rank * plan.procs_per_node + local_rank
    return sorted((plan.run_dir / LOGS_DIR).glob(f"*_rank{rank}.log"))[-1:]


def link_rank_logs(plan: LaunchPlan) -> bool:
    """RUN/logs/rank<K> -> torchrun's folder for global rank K, so `tail logs/rank1/stderr.log` works.

    Returns whether every local rank's folder was there to link."""
    if plan.launcher != "torchrun":
        return True
    attempt = torchrun_attempt_dir(plan.run_dir)
    if attempt is None:
        return False
    logs = plan.run_dir / LOGS_DIR
    local_dirs = [d for d in attempt.iterdir() if d.name.isdigit()]
    for local_dir in local_dirs:
        if not local_dir.name.isdigit():
            continue
        rank = plan.node_rank * plan.procs_per_node + int(local_dir.name)
        link = logs / f"rank{rank}"
        try:
            if link.is_symlink() and link.resolve() != local_dir.resolve():
                link.unlink()  # a restarted attempt: point at the new folder
            if not link.exists():
                link.symlink_to(local_dir.relative_to(logs), target_is_directory=True)
        except OSError:
            pass  # filesystems without symlinks: the logs are still under logs/torchrun
    return len(local_dirs) >= plan.procs_per_node
