"""Launching the per-rank runner and watching it: the command lines (`commands`), the running processes (`supervision`) and what they came to (`outcome`)."""

from finetune.run.launch.commands import (
    DEEPSPEED_ENV_FILE, DEFAULT_MASTER_PORT, LOCAL_HOSTS, LOG_LINE_PREFIX, PROPAGATED_ENV, RUNNER_MODULE, HostfileError,
    LaunchPlan, choose_launcher, commands_per_node, deepspeed_argv, deepspeed_env_text, free_port, plan_launch,
    procs_per_node, read_hostfile, torchrun_argv,
)
from finetune.run.launch.outcome import (
    LAUNCHER_ERROR_FILE, Outcome, RankFailure, judge, link_rank_logs, parse_torchrun_failures, port_in_use,
    rank_log_files, read_error_file, tail_of, torchrun_attempt_dir, torchrun_failures,
)
from finetune.run.launch.supervision import (
    PORT_RETRIES, STOP_SIGNALS, Follower, LaunchError, ProcessTree, Relay, spawn, supervise, wait,
)

__all__ = [
    "DEEPSPEED_ENV_FILE", "DEFAULT_MASTER_PORT", "LAUNCHER_ERROR_FILE", "LOCAL_HOSTS", "LOG_LINE_PREFIX", "PORT_RETRIES",
    "PROPAGATED_ENV", "RUNNER_MODULE", "STOP_SIGNALS", "Follower", "HostfileError", "LaunchError", "LaunchPlan",
    "Outcome", "ProcessTree", "RankFailure", "Relay", "choose_launcher", "commands_per_node", "deepspeed_argv",
    "deepspeed_env_text", "free_port", "judge", "link_rank_logs", "parse_torchrun_failures", "plan_launch",
    "port_in_use", "procs_per_node", "rank_log_files", "read_error_file", "read_hostfile", "spawn", "supervise",
    "tail_of", "torchrun_argv", "torchrun_attempt_dir", "torchrun_failures", "wait",
]
