"""Add this project's GPU acceptance runs to the planner's corpus (tests/data/plan_corpus.json).

    python scripts/acceptance_to_corpus.py docs/gpu_acceptance/DATE_GPU_SLICE.json
    python scripts/acceptance_to_corpus.py RESULTS.json --dry-run    # print the cases, change nothing
    python scripts/plan_corpus.py --widths                             # then: the bound's widths changed

Each run of scripts/gpu_acceptance.py that trained (`ok`) and whose peak the runner read over the
training steps alone (summary.json's `peak_memory_scope`: "training") becomes one case of the source
`finetune-gpu-acceptance`: `max_memory_allocated` of its largest rank, with the settings the harness's
recipe had. Results written before the runner recorded that scope give no case (their LoRA and Q-LoRA
peaks include the verification forward: docs/plan.md, "Seventh pass"). A case names the results file and
the commit it measured; the file must be in this repository (docs/gpu_acceptance/) for the corpus to cite
it. Cases already in the corpus (same id) are left as they are. Every such case is held out: it came after
the planner's constants were fitted, and none is fitted to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from finetune.plan.allocator import expandable_in_training  # noqa: E402
from finetune.units import GiB  # noqa: E402

CORPUS = REPO / "tests" / "data" / "plan_corpus.json"
SOURCE = "finetune-gpu-acceptance"


def model_key(name: str) -> str:
    return f"acceptance-{name}"


def planned_settings(setup: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The settings only the run's own plan knows (`finetune plan --format json`'s setup, which the harness records
    as plan_setup): the recipe's LoRA dropout, DeepSpeed's reduce bucket as `auto` became and the optimizer it wraps
    (its FusedAdam or another), and whether every row was cut to max_length one per micro batch (no mask). Without
    them the corpus would plan Setup's defaults, as it did for the H200's rows of 2026-11-27 (docs/plan.md, "Ninth
    pass")."""
    if not setup:
        return {}
    out = {key: setup[key] for key in ("lora_dropout", "full_rows") if key in setup}
    if setup.get("deepspeed"):
        out.update({key: setup[key] for key in ("reduce_bucket_size", "ds_fused_adam") if setup.get(key) is not None})
    return out


def cases_from(results: dict[str, Any], file: str) -> tuple[dict[str, dict], list[dict]]:
    """({corpus model name: entry}, [cases]) for the runs of one results file that measured training alone."""
    machine, commit = results["machine"], results.get("commit")
    models: dict[str, dict] = {}
    cases = []
    for run in results["runs"]:
        if run.get("status") != "ok" or run.get("peak_memory_scope") != "training" or not run.get("peak_memory_bytes"):
            continue
        config = results.get("models", {}).get(run["model"])
        if config is None:
            raise ValueError(f"{file}: no shapes recorded for model {run['model']!r} (results.models)")
        models[model_key(run["model"])] = {"config": config, "note": f"scripts/gpu_acceptance.py MODELS[{run['model']!r}]: "
                                           "a public model's config.json shapes, random weights"}
        cases.append({
            "id": f"{SOURCE}/{Path(file).stem}/{run['name']}",
            "source": SOURCE,
            "row": run["name"],
            "file": file,
            "commit": commit,
            "model": model_key(run["model"]),
            "measured_gib": round(run["peak_memory_bytes"] / GiB, 3),
            "settings": {
                "gpu_type": machine["gpu_name"], "method": run["method"], "dtype": run["dtype"], "attn": run["attn"],
                # scripts/gpu_speed.py's memory rows say what `auto` became (engine, checkpointing, loss, batch)
                "deepspeed": run.get("deepspeed", True) is not False, "stage": run["stage"],
                "offload_optimizer": "cpu" if run["offload"] else "none",
                "gpus_per_node": run["gpus"], "nodes": 1, "micro_batch": run["micro_batch"],
                "seq_len": run["max_length"], "packing": run["packing"],
                "gradient_checkpointing": run.get("gradient_checkpointing", True),
                "gradient_accumulation": run.get("gradient_accumulation", 1),
                "loss_kernel": run.get("loss_kernel") or results.get("loss_kernel", "default"),
                # `finetune train` sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the allocator is
                # configured (the harness does for one case: gpu_speed's record `env`)
                "expandable_segments": expandable_in_training(run.get("env") or {}),
                **planned_settings(run.get("plan_setup")),
            },
            "holdout": True,
        })
    return models, cases


def add(corpus: dict[str, Any], models: dict[str, dict], cases: list[dict]) -> list[str]:
    """Adds what is new to `corpus` in place; returns the ids added."""
    if SOURCE not in corpus["sources"]:
        raise ValueError(f"the corpus has no source {SOURCE!r}: it describes what these cases measured")
    known = {c["id"] for c in corpus["cases"]}
    for name, entry in models.items():
        corpus["models"].setdefault(name, entry)
    added = [c for c in cases if c["id"] not in known]
    corpus["cases"].extend(added)
    return [c["id"] for c in added]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a results.json of scripts/gpu_acceptance.py, in docs/gpu_acceptance/")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--dry-run", action="store_true", help="print the cases; write nothing")
    args = parser.parse_args(argv)
    path = args.results.resolve()
    try:
        file = str(path.relative_to(REPO))
    except ValueError:
        print(f"acceptance_to_corpus: {args.results} is not in this repository: commit it under "
              "docs/gpu_acceptance/ first, so that the corpus can cite it", file=sys.stderr)
        return 2
    results = json.loads(path.read_text(encoding="utf-8"))
    models, cases = cases_from(results, file)
    if args.dry_run:
        print(json.dumps(cases, indent=1))
        return 0
    corpus = json.loads(args.corpus.read_text(encoding="utf-8"))
    added = add(corpus, models, cases)
    tmp = args.corpus.with_name(f".{args.corpus.name}.tmp")
    tmp.write_text(json.dumps(corpus, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, args.corpus)
    skipped = len(results["runs"]) - len(cases)
    print(f"{len(added)} case(s) added, {len(cases) - len(added)} already there, {skipped} run(s) not usable "
          "(not ok, or peak not over training alone); now: python scripts/plan_corpus.py --widths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
