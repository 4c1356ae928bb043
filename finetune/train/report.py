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

from finetune.fsutil import write_atomic

PLOT_FILE = "loss.png"
REPORT_FILE = "report.html"
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
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a GPU box
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import io

    series = curves(log_history)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=[3, 1.2])
    try:
        if series["loss"]:
            top.plot(*zip(*series["loss"]), label="train loss", color="tab:blue", linewidth=1.4)
        if series["eval_loss"]:
            top.plot(*zip(*series["eval_loss"]), "o-", label="eval loss", color="tab:orange", linewidth=1.4)
        top.set_ylabel("loss")
        top.grid(alpha=0.3)
        if series["loss"] or series["eval_loss"]:
            top.legend(loc="upper right")
        top.set_title(title or "loss")
        if series["learning_rate"]:
            bottom.plot(*zip(*series["learning_rate"]), color="tab:green", linewidth=1.2)
        bottom.set_ylabel("learning rate")
        bottom.set_xlabel("optimizer step")
        bottom.grid(alpha=0.3)
        bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
    finally:
        plt.close(fig)
    write_atomic(Path(path), buffer.getvalue())
    return True


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


def _gib(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def plan_estimate(run_dir: Path, world_size: int) -> tuple[Optional[dict[str, int]], str]:
    """The planner's per-GPU bytes for this run's recipe and world size, or (None, why not)."""
    from finetune import plan as planner
    from finetune.rundir.layout import RunDirError, read_run_dir

    try:
        recipe, _, _ = read_run_dir(run_dir)
        return planner.plan_recipe(recipe, gpus=world_size, nodes=1).per_gpu, ""
    except (RunDirError, planner.PlanError, ValueError) as exc:
        return None, str(exc)


def next_steps(run_dir: Path, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, command) pairs for what a user does after this run."""
    run = str(run_dir)
    name = run_dir.name
    steps = [("chat with it", f"finetune chat {run}")]
    if summary.get("objective", "sft") == "sft":  # a preference loss is not a perplexity
        steps.append(("loss and perplexity, base vs fine-tuned", f"finetune eval {run}"))
    output = summary.get("output")
    if output == "adapter":
        steps.append(("merge the adapter into the base (CPU, streaming)", f"finetune merge {run} -o merged/{name}"))
    checkpoints = sorted((p for p in run_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                         key=lambda p: int(p.name.split("-")[-1]))
    if checkpoints:
        newest = checkpoints[-1]
        steps.append((f"turn {newest.name} into an adapter or weights", f"finetune convert {newest} -o {run}/{newest.name}-hf"))
        steps.append(("train further from the newest checkpoint (after raising training.max_steps or epochs)",
                      f"finetune train {run}/recipe.yaml --force-resume"))
    steps.append(("TensorBoard", f"tensorboard --logdir {run}/tensorboard"))
    return steps


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
    summary = _json(run_dir / "summary.json") or {}
    env = _json(run_dir / "env.json") or {}
    ds_path = run_dir / "deepspeed.effective.json"
    ds_text = _read(ds_path) or _read(run_dir / "deepspeed.json") or "(missing)"
    recipe_text = _read(run_dir / "recipe.yaml") or "(missing)"
    world = int(summary.get("world_size") or env.get("world_size") or 1)
    per_gpu, why_no_plan = plan_estimate(run_dir, world)
    name = run_dir.name

    parts = [f"<h1>Run {html.escape(name)}</h1>",
             f"<p class=where>{html.escape(str(run_dir.resolve()))}</p>"]
    facts = [
        ("steps", str(summary.get("steps", "n/a"))),
        ("epochs", f"{summary['epochs']:.2f}" if isinstance(summary.get("epochs"), (int, float)) else "n/a"),
        ("train loss, first -> last", f"{_num(summary.get('train_loss_first'))} -> {_num(summary.get('train_loss_last'))}"),
        ("eval loss, last", _num(summary.get("eval_loss_last"))),
        ("tokens trained", f"{summary.get('tokens_trained', 0):,}"),
        ("tokens/s (since the last start)", _num(summary.get("tokens_per_second"), ".0f")),
        ("training wall time", f"{_num(summary.get('wall_seconds'), '.1f')} s"),
        ("method, ZeRO stage", f"{summary.get('method', 'n/a')}, {summary.get('zero_stage', 'n/a')}"),
        ("parameters trainable / total",
         f"{summary.get('trainable_parameters', 0):,} / {summary.get('total_parameters', 0):,}"),
        ("world size, devices", f"{world}, {env.get('devices', 'n/a')}"),
        ("output", f"{summary.get('output', 'n/a')}/"),
    ]
    if summary.get("resumed_from"):
        facts.append(("resumed from", str(summary["resumed_from"])))
    parts.append(_section("Summary", _table(facts)))
    from finetune.train.startup import rows as startup_rows

    started = startup_rows(summary.get("startup"))
    if started:
        parts.append(_section("Start-up: the time before the first optimizer step", _table(started, ("stage", "took"))))
    if plot_written and (run_dir / PLOT_FILE).is_file():
        data = base64.b64encode((run_dir / PLOT_FILE).read_bytes()).decode("ascii")
        plot = f'<img alt="train and eval loss, learning rate" src="data:image/png;base64,{data}">'
    else:
        plot = f"<p>No plot: matplotlib is not installed ({html.escape(PLOT_HINT)}).</p>"
    parts.append(_section("Loss and learning rate", plot))
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
    parts.append(_section("Next", _table([(w, c) for w, c in next_steps(run_dir, summary)], ("what", "command"))))
    parts.append(_section("Recipe (recipe.yaml, resolved)", _pre(recipe_text)))
    parts.append(_section(f"DeepSpeed config ({ds_path.name if ds_path.is_file() else 'deepspeed.json'})", _pre(ds_text)))
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


def _num(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


def write_run_report(run_dir: Path, log_history: list[dict[str, Any]]) -> list[str]:
    """loss.png (when matplotlib is there) and report.html; returns notes for the console."""
    run_dir = Path(run_dir)
    notes = []
    plotted = plot_loss(log_history, run_dir / PLOT_FILE, title=run_dir.name)
    if not plotted:
        notes.append(f"loss.png not written: matplotlib is not installed ({PLOT_HINT})")
    write_atomic(run_dir / REPORT_FILE, render_report(run_dir, plotted))
    return notes
