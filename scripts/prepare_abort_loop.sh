#!/bin/bash
# `finetune prepare` on a JSON lines file whose first MiB is bad, N times (PAR at a time): every run must exit 1.
# Issue 34 item 10: 6 runs in 200 aborted at exit with "terminate called without an active exception" (134)
# when fastcheck handed pyarrow's streaming reader the Python bytes of a range (finetune/data/fastcheck.py).
#
#     scripts/prepare_abort_loop.sh [N=200] [PAR=4]
#
# Prints the count of each exit code and keeps the stderr of every run that did not exit 1.
set -u
n=${1:-200}; par=${2:-4}
repo=$(cd "$(dirname "$0")/.." && pwd)
finetune=${FINETUNE:-$repo/.venv/bin/finetune}
work=$(mktemp -d)
"$repo/.venv/bin/python" - "$work" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
# 2,000 bad rows first (more than validate's 1,000-problem stop), then 98,000 good ones: ~15 MB, one bulk range
rows = [json.dumps({"instruction": f"Add {i} and 1. " + "word " * 20, "output": 7 if i < 2000 else f"{i + 1}"})
        for i in range(100_000)]
(work / "rows.jsonl").write_text("\n".join(rows) + "\n")
(work / "r.yaml").write_text(f"model: {{name_or_path: 'builtin:tiny-llama'}}\ndata: {{path: {work / 'rows.jsonl'}}}\n")
PY
export PYTHONFAULTHANDLER=1 work finetune
seq 1 "$n" | xargs -P "$par" -I{} sh -c '"$finetune" prepare "$work/r.yaml" > /dev/null 2> "$work/err.{}"; rc=$?;
  echo $rc; [ $rc -eq 1 ] && rm -f "$work/err.{}"' | sort | uniq -c | sed 's/^ *\([0-9]*\) \(.*\)/exit \2: \1 runs/'
left=$(ls "$work"/err.* 2>/dev/null | wc -l)
[ "$left" -gt 0 ] && echo "stderr of the other runs: $work/err.*" || rm -rf "$work"
