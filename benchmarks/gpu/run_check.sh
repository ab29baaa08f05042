#!/usr/bin/env bash
# The one-shot GPU check on a lent machine (no package registry; its own Python, torch and triton): installs the
# wheels carried in .whl (transformers of the supported range, hf-kvcache) into /tmp/site, then runs
# `hf-kvcache gpu-check` into $OUT (or ./gpu_check_out). Build the wheels here first: benchmarks/gpu/wheels.sh.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
cd /tmp && python3 -m hf_kvcache.eval.gpu_check --out "$OUT" --budget-s "${BUDGET_S:-360}" "$@" 2>&1 | tee "$OUT/log.txt"
