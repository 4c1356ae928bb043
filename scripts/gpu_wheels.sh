#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, for scripts/gpu_speed.py (docs/gpu-acceptance.md, "The next GPU run"),
# downloaded here (PyPI) into .whl/ (git-ignored), and their size with the repository's checked against the 64 MiB
# that travels to the GPU machine. That image (Python 3.12, x86-64) has torch 2.11, transformers 5.17,
# accelerate 1.15, peft, safetensors, tokenizers, pyarrow, tensorboard, matplotlib, typer, psutil, ninja, msgpack,
# py-cpuinfo, einops, xxhash (/work/.library/device/KINDS.md); the versions below are the ones the tests here ran.
#
#   bash scripts/gpu_wheels.sh            # -> .whl/*.whl, and "total ... of 64 MiB"
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.whl
PYTHON=${PYTHON:-.venv/bin/python}
LIMIT=$((64 * 1024 * 1024))
rm -rf "$OUT"
mkdir -p "$OUT"
# pip matches manylinux_2_N exactly: bitsandbytes 0.50.2 is tagged 2_24 (with only 2_17/2_28, pip picks 0.42.0, 105 MB).
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$OUT" \
    bitsandbytes==0.50.2 \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    ruamel.yaml==0.19.1 ruamel.yaml.clib==0.2.15 hjson==3.1.0 orjson==3.13.0 \
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    liger-kernel==0.8.5
# DeepSpeed is published as an sdist only: a pure-Python wheel of it (its ops are compiled on the GPU machine).
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" deepspeed==0.19.8
# The commit the working tree is sent from (the GPU machine's .git is the last landed commit's); "+changes" when the
# tree differs from it. scripts/gpu_acceptance.py's git_commit() reads it.
{ git rev-parse HEAD | tr -d '\n'; [ -z "$(git status --porcelain --untracked-files=no)" ] || printf '+changes'; echo; } > "$OUT/COMMIT"
wheels=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
repo=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | grep total$ | cut -f1 | paste -sd+ | bc)
total=$((wheels + repo))
ls -l "$OUT"
printf 'wheels %.1f MiB + repository %.1f MiB = %.1f MiB of 64 MiB\n' \
    "$(echo "$wheels / 1048576" | bc -l)" "$(echo "$repo / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt "$LIMIT" ]; then
    echo "gpu_wheels: over the 64 MiB that travels with the repository" >&2
    exit 1
fi
