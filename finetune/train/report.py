"""What a run directory shows a person: loss.png and report.html (rank 0 writes both).

loss.png: train and eval loss, and the learning rate, against the optimizer step. It is drawn from
the trainer state's log history, which a resumed run reloads from its checkpoint, so the plot of a
resumed run covers the whole run. matplotlib is optional (the `train` extra installs it); without it
the run finishes anyway and says how to get the plot.

report.html: one self-contained page (the plot is embedded) with the recipe, the DeepSpeed config as
run, the planner's per-GPU estimate beside the measured peak memory of every rank, throughput,
library versions, and the commands that come next (resume, convert, merge, chat, eval).

No torch here: `finetune` can rebuild a report on a box without it.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any, Optional

from finetune import objectives
from finetune.fsutil import write_atomic
from finetune.rundir.names import (
    AUTO_FILE, BENCHMARKS_KEY, DEEPSPEED_EFFECTIVE_FILE, DEEPSPEED_FILE, EVAL_FILE, PLOT_FILE, REPORT_FILE,
)
from finetune.units import gib_text

REWARD_PLOT_FILE = "rewards.png"  # GRPO: mean reward, each reward, KL, length; dpo/orpo/kto/simpo: TRL's rewards/*
SAMPLES_FILE = "completions.jsonl"  # written by finetune.train.grpo.completion_samples
PLOT_HINT = "pip install matplotlib (or pip install 'finetune[train]')"


def curves(log_history: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """(step, value) series of train loss, eval loss and learning rate from a Trainer log history."""
    out: dict[str, list[tuple[float, float]]] = {"loss": [], "eval_loss": [], "learning_rate": []}
    for entry in log_history:
        step = entry.get("step")
        if step is None:
            continue
        for key in out:
            value = entry.get(key)
            if isinstance(value, (int, float)):
                out[key].append((float(step), float(value)))
    return out


def plot_loss(log_history: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Write the loss / learning-rate plot; False when matplotlib is not installed."""
    plt = _pyplot()
    if plt is None:
        return False
    _write_png(plt, _draw_loss(plt, curves(log_history), title or "loss"), path)
    return True


def _draw_loss(plt, series, title: str):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=[3, 1.2])
    if series["loss"]:
        top.plot(*zip(*series["loss"]), label="train loss", color="tab:blue", linewidth=1.4)
    if series["eval_loss"]:
        top.plot(*zip(*series["eval_loss"]), "o-", label="eval loss", color="tab:orange", linewidth=1.4)
    top.set_ylabel("loss")
    top.grid(alpha=0.3)
    if series["loss"] or series["eval_loss"]:
        top.legend(loc="upper right")
    top.set_title(title)
    if series["learning_rate"]:
        bottom.plot(*zip(*series["learning_rate"]), color="tab:green", linewidth=1.2)
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return fig


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display on a GPU box), or None when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _write_png(plt, fig, path: Path) -> None:
    """The figure as a PNG at `path`, atomically; the figure is closed either way."""
    import io

    try:
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
    finally:
        plt.close(fig)
    write_atomic(Path(path), buffer.getvalue())


def reward_curves(log_history: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """(step, value) series of the rewards TRL logged while training (entries with a `loss`, so no eval_*):
    GRPOTrainer's `reward`, `rewards/<name>/mean`, `kl`, `completions/mean_length`; the preference trainers'
    `rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`. GRPO is told apart by its
    `reward` (the weighted sum), which the preference trainers never log."""
    out: dict[str, list[tuple[float, float]]] = {}
    for entry in log_history:
        step = entry.get("step")
        if step is None or "loss" not in entry:
            continue
        grpo = "reward" in entry
        for key, value in entry.items():
            if grpo:
                wanted = key in ("reward", "kl", "completions/mean_length") or \
                    (key.startswith("rewards/") and key.endswith("/mean"))
            else:
                wanted = key.startswith("rewards/")
            if wanted and isinstance(value, (int, float)):
                out.setdefault(key, []).append((float(step), float(value)))
    return out


def plot_rewards(log_history: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """rewards.png: for GRPO the mean reward and each reward function, KL and completion length; for the
    preference objectives chosen, rejected and margins above, accuracies below. False without matplotlib
    or without any reward logged (sft)."""
    series = reward_curves(log_history)
    plt = _pyplot() if series else None
    if plt is None:
        return False
    draw = _draw_grpo_rewards if "reward" in series else _draw_preference_rewards
    _write_png(plt, draw(plt, series, title or "rewards"), path)
    return True


def _draw_grpo_rewards(plt, series, title: str):
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 1.2, 1.2])
    top.plot(*zip(*series["reward"]), label="mean reward (weighted sum)", color="tab:blue", linewidth=1.6)
    for key, points in series.items():
        if key.startswith("rewards/"):
            top.plot(*zip(*points), label=key.split("/")[1], linewidth=1, alpha=0.7)
    top.set_ylabel("reward")
    top.legend(loc="best", fontsize="small")
    top.set_title(title)
    for axis, key, label in ((middle, "kl", "KL to reference"), (bottom, "completions/mean_length", "completion tokens")):
        if key in series:
            axis.plot(*zip(*series[key]), color="tab:purple", linewidth=1.2)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    top.grid(alpha=0.3)
    bottom.set_xlabel("optimizer step")
    return fig


def _draw_preference_rewards(plt, series, title: str):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=[3, 1.2])
    for key, points in sorted(series.items()):
        if key != "rewards/accuracies":
            top.plot(*zip(*points), label=key.split("/", 1)[1], linewidth=1.4)
    top.axhline(0.0, color="#999", linewidth=0.8)
    top.set_ylabel("reward")
    top.legend(loc="upper left")
    top.set_title(title)
    if "rewards/accuracies" in series:
        bottom.plot(*zip(*series["rewards/accuracies"]), color="tab:purple", linewidth=1.2)
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_ylabel("accuracy")
    bottom.set_xlabel("optimizer step")
    top.grid(alpha=0.3)
    bottom.grid(alpha=0.3)
    return fig


# ------------------------------------------------------------------------------------------------
# report.html


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def _json(path: Path) -> Optional[Any]:
    text = _read(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    text = _read(path) or ""
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


def _gib(n: Optional[float]) -> str:
    return "n/a" if n is None else gib_text(n)


def plan_estimate(run_dir: Path, world_size: int) -> tuple[Optional[dict[str, int]], str]:
    """The planner's per-GPU bytes for this run's recipe and world size, or (None, why not)."""
    from finetune import plan as planner
    from finetune.rundir.layout import read_run_dir
    from finetune.rundir.errors import RunDirError

    try:
        recipe, _, _ = read_run_dir(run_dir)
        return planner.plan_recipe(recipe, gpus=world_size, nodes=1).per_gpu, ""
    except (RunDirError, planner.PlanError, ValueError) as exc:
        return None, str(exc)


def next_steps(run_dir: Path, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, command) rows of the report's Next table: finetune.serve.next_steps decides them (the list `finetune
    train` prints, for the report; issue 39)."""
    from finetune.serve import next_steps as serve_next_steps

    saved = [summary["output"]] if summary.get("output") else None
    return [(why, command) for command, why in serve_next_steps(run_dir, summary.get("objective", "sft"),
                                                                for_report=True, saved=saved)]


def _section(title: str, body: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>\n{body}\n</section>\n"


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _table(rows: list[tuple[str, ...]], header: Optional[tuple[str, ...]] = None) -> str:
    head = "" if header is None else \
        "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr></thead>\n"
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>\n" for row in rows)
    return f"<table>{head}<tbody>\n{body}</tbody></table>"


def memory_rows(summary: dict[str, Any], per_gpu: Optional[dict[str, int]]) -> list[tuple[str, ...]]:
    kind = summary.get("peak_memory_kind") or ""
    measured_what = {"cuda_max_memory_allocated": "torch.cuda.max_memory_allocated",
                     "cpu_peak_rss": "peak RSS of the CPU process"}.get(kind, kind)
    rows = []
    for rank, peak in enumerate(summary.get("peak_memory_bytes") or []):
        planned = _gib(per_gpu["total"]) if per_gpu else "n/a"
        rows.append((str(rank), planned, _gib(peak), measured_what))
    return rows


def render_report(run_dir: Path, plot_written: bool) -> str:
    run_dir = Path(run_dir)
    from finetune.rundir.names import ENV_FILE, RECIPE_FILE, SUMMARY_FILE

    summary = _json(run_dir / SUMMARY_FILE) or {}
    env = _json(run_dir / ENV_FILE) or {}
    ds_path = run_dir / DEEPSPEED_EFFECTIVE_FILE
    ds_text = _read(ds_path) or _read(run_dir / DEEPSPEED_FILE) or "(missing)"
    recipe_text = _read(run_dir / RECIPE_FILE) or "(missing)"
    world = int(summary.get("world_size") or env.get("world_size") or 1)
    per_gpu, why_no_plan = plan_estimate(run_dir, world)
    name = run_dir.name

    parts = [f"<h1>Run {html.escape(name)}</h1>",
             f"<p class=where>{html.escape(str(run_dir.resolve()))}</p>"]
    facts = [
        ("steps", str(summary.get("steps", "n/a"))),
        ("epochs", f"{summary['epochs']:.2f}" if isinstance(summary.get("epochs"), (int, float)) else "n/a"),
        ("train loss, first -> last", _loss_span(summary)),
        ("eval loss, last", _num(summary.get("eval_loss_last"))),
        ("tokens trained", f"{summary.get('tokens_trained', 0):,}"),
        ("tokens/s (since the last start)", _num(summary.get("tokens_per_second"), ".0f")),
        ("tokens/s, steady (finetune.speed)", _num((summary.get("steady") or {}).get("tokens_per_second"), ".0f")),
        ("training wall time", f"{_num(summary.get('wall_seconds'), '.1f')} s"),
        ("method, ZeRO stage", f"{summary.get('method', 'n/a')}, " + (
            "no DeepSpeed (the plain Trainer)" if summary.get("deepspeed") is False else str(summary.get("zero_stage", "n/a")))),
        ("parameters trainable / total",
         f"{summary.get('trainable_parameters', 0):,} / {summary.get('total_parameters', 0):,}"),
        ("world size, devices", f"{world}, {env.get('devices', 'n/a')}"),
        ("output", f"{summary.get('output', 'n/a')}/"),
    ]
    if summary.get("resumed_from"):
        facts.append(("resumed from", str(summary["resumed_from"])))
    parts.append(_section("Summary", _table(facts)))
    from finetune.train.startup import rows as startup_rows

    steady = steady_rows(summary.get("steady"))
    if steady:
        parts.append(_section("Speed: the steady state, after the warm-up steps", _table(steady, ("what", "value"))))
    started = startup_rows(summary.get("startup"))
    if started:
        parts.append(_section("Start-up: the time before the first optimizer step", _table(started, ("stage", "took"))))
    if plot_written and (run_dir / PLOT_FILE).is_file():
        data = base64.b64encode((run_dir / PLOT_FILE).read_bytes()).decode("ascii")
        plot = f'<img alt="train and eval loss, learning rate" src="data:image/png;base64,{data}">'
    else:
        plot = f"<p>No plot: matplotlib is not installed ({html.escape(PLOT_HINT)}).</p>"
    parts.append(_section("Loss and learning rate", plot))
    objective = objectives.get(summary.get("objective", objectives.SFT.name))
    if objective.generates:
        parts.extend(_grpo_sections(run_dir, summary))
    elif objective.uses_trl:
        parts.append(_section("Preference rewards", _rewards_body(run_dir, summary)))
    memory = memory_rows(summary, per_gpu)
    note = ("<p>Planned: <code>finetune plan</code>'s per-GPU peak for this recipe on "
            f"{world} GPU{'s' if world != 1 else ''}.")
    if summary.get("peak_memory_kind") == "cpu_peak_rss":
        note += (" This run used CPU processes: the measured number is each process's peak RSS (Python, "
                 "libraries and data included), not GPU memory, so it does not test the plan.")
    note += "</p>"
    if per_gpu is None:
        note += f"<p>No plan: {html.escape(why_no_plan)}</p>"
    parts.append(_section("Memory per rank: plan vs measured",
                          _table(memory, ("rank", "planned (per GPU)", "measured peak", "measured as")) + note))
    evaluated = _eval_body(run_dir)
    if evaluated:
        parts.append(_section("Evaluation (finetune eval: base vs fine-tuned)", evaluated))
    parts.append(_section("Next", _table([(w, c) for w, c in next_steps(run_dir, summary)], ("what", "command"))))
    parts.append(_section(f"Recipe ({RECIPE_FILE}, resolved)", _pre(recipe_text)))
    if summary.get("deepspeed") is False:
        parts.append(_section("DeepSpeed", "<p>Not used: deepspeed.enabled is false for this run (transformers' "
                                           "Trainer alone, torch's fused AdamW; see auto.json).</p>"))
    else:
        parts.append(_section(f"DeepSpeed config ({ds_path.name if ds_path.is_file() else DEEPSPEED_FILE})", _pre(ds_text)))
    auto = _json(run_dir / AUTO_FILE) or {}
    if auto.get("choices"):
        rows = [(c.get("key", ""), json.dumps(c.get("value")), c.get("reason", "")) for c in auto["choices"]]
        parts.append(_section("auto: what the recipe's `auto` keys became on this machine",
                              _table(rows, ("key", "value", "why"))))
    versions = env.get("versions") or {}
    rows = [(k, str(v)) for k, v in versions.items()] + [("cuda", str(env.get("cuda"))), ("platform", str(env.get("platform")))]
    parts.append(_section("Versions", _table(rows, ("library", "version"))))
    style = ("body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}"
             "table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ccc;padding:.25rem .6rem;"
             "text-align:left;vertical-align:top}pre{background:#f6f6f6;padding:.6rem;overflow:auto;font-size:.85rem}"
             "img{max-width:100%}.where{color:#666}code,td:last-child{font-family:ui-monospace,monospace}")
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>finetune run {html.escape(name)}</title><style>{style}</style></head>\n<body>\n"
            + "\n".join(parts) + "</body></html>\n")


def steady_rows(steady: Optional[dict[str, Any]]) -> list[tuple[str, str]]:
    """summary.json's `steady` (finetune.speed) as (what, value) rows; none for a run directory from before it."""
    if not steady:
        return []
    if steady.get("tokens_per_second") is None:
        return [("steady state", f"n/a: {steady.get('reason') or 'no tokens counted'}")]
    first = steady["warmup_steps"] + 1
    rows = [("tokens/s", f"{steady['tokens_per_second']:,.0f} (all ranks), steps {first} to "
                         f"{steady['warmup_steps'] + steady['steps']} of this start"),
            ("step time, p50 / p90", f"{steady['step_seconds_p50']:.4g} s / {steady['step_seconds_p90']:.4g} s "
                                     "(host clock at each step's end)")]
    if steady.get("flops_per_token"):
        rows.append(("model FLOPs per token", f"{steady['flops_per_token'] / 1e9:,.2f} G ({steady.get('flops_basis')})"))
    if steady.get("mfu") is not None:
        rows.append(("MFU", f"{100 * steady['mfu']:.1f}% of {steady.get('gpu')}'s dense bf16 peak "
                            f"({steady.get('peak_source')})"))
    elif steady.get("reason"):
        rows.append(("MFU", f"n/a: {steady['reason']}"))
    return rows


def _grpo_sections(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """The reward curves (rewards.png, embedded) and the sample completions of a GRPO run."""
    parts = []
    if (run_dir / REWARD_PLOT_FILE).is_file():
        data = base64.b64encode((run_dir / REWARD_PLOT_FILE).read_bytes()).decode("ascii")
        reward = summary.get("mean_reward") or {}
        line = f"<p>Mean reward, first -> last step: {_num(reward.get('first'))} -> {_num(reward.get('last'))}</p>"
        parts.append(_section("Rewards, KL and completion length",
                              line + f'<img alt="mean reward, KL, completion length" src="data:image/png;base64,{data}">'))
    samples = _jsonl(run_dir / SAMPLES_FILE)
    if samples:
        rows = [(str(s.get("step")), s.get("prompt", ""), s.get("completion", ""),
                 ", ".join(f"{k} {_num(v, '.3f')}" for k, v in (s.get("rewards") or {}).items()),
                 _num(s.get("advantage"), ".3f")) for s in samples]
        parts.append(_section("Sample completions (first step, every quarter, last step)",
                              _table(rows, ("step", "prompt (end)", "completion", "rewards", "advantage"))))
    return parts


def _rewards_body(run_dir: Path, summary: dict[str, Any]) -> str:
    """The reward curves (rewards.png, embedded) and every preference metric's first and last value."""
    body = ""
    if (run_dir / REWARD_PLOT_FILE).is_file():
        data = base64.b64encode((run_dir / REWARD_PLOT_FILE).read_bytes()).decode("ascii")
        body += f'<img alt="rewards: chosen, rejected, margins, accuracies" src="data:image/png;base64,{data}">'
    metrics = summary.get("preference_metrics") or {}
    rows = [(name, f"{_num(v.get('first'))} -> {_num(v.get('last'))}") for name, v in sorted(metrics.items())]
    return body + (_table(rows, ("metric", "first -> last")) if rows else "<p>No preference metric was logged.</p>")


def _eval_body(run_dir: Path) -> str:
    """eval.json's loss and perplexity and its lm-eval benchmarks (`finetune eval --tasks`), one table each."""
    record = _json(run_dir / EVAL_FILE)
    if not isinstance(record, dict):
        return ""
    body = ""
    if isinstance(record.get("base"), dict) and isinstance(record.get("tuned"), dict) and "loss" in record["tuned"]:
        rows = [(who, _num(record[key].get("loss")), _num(record[key].get("perplexity"), ".2f"))
                for who, key in (("base", "base"), ("fine-tuned", "tuned"))]
        body += f"<p>{html.escape(str(record.get('data', '')))}</p>" + _table(rows, ("model", "loss", "perplexity"))
    bench = record.get(BENCHMARKS_KEY)
    if isinstance(bench, dict):
        rows = [(task, metric, _num(v.get("base")), _num(v.get("fine_tuned")))
                for task, entry in (bench.get("tasks") or {}).items()
                for metric, v in (entry.get("metrics") or {}).items()]
        body += (f"<p>lm-evaluation-harness {html.escape(str(bench.get('lm_eval')))}, prompted as the run trained "
                 f"({html.escape(str(bench.get('prompt')))})</p>" + _table(rows, ("task", "metric", "base", "fine-tuned")))
    return body


def _loss_span(summary: dict[str, Any]) -> str:
    history = summary.get("loss_history") or []
    if len(history) == 1:  # one logged step: no span to show (issue 34)
        return f"{_num(history[0].get('loss'))} (step {history[0].get('step')}, the only one logged)"
    return f"{_num(summary.get('train_loss_first'))} -> {_num(summary.get('train_loss_last'))}"


def _num(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


def write_run_report(run_dir: Path, log_history: list[dict[str, Any]]) -> list[str]:
    """loss.png (when matplotlib is there) and report.html; returns notes for the console."""
    run_dir = Path(run_dir)
    notes = []
    plotted = plot_loss(log_history, run_dir / PLOT_FILE, title=run_dir.name)
    if not plotted:
        notes.append(f"loss.png not written: matplotlib is not installed ({PLOT_HINT})")
    plot_rewards(log_history, run_dir / REWARD_PLOT_FILE, title=f"{run_dir.name}: rewards")
    write_atomic(run_dir / REPORT_FILE, render_report(run_dir, plotted))
    return notes
