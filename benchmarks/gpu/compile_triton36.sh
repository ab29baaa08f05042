#!/usr/bin/env bash
# Compile every Triton kernel for sm_90 with triton 3.6 (the lent GPU machines' release), without a GPU: a venv beside
# the project's with triton==3.6.0 instead of its own. Usage: benchmarks/gpu/compile_triton36.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-/tmp/venv-triton36}
if [ ! -x "$VENV/bin/python" ]; then
  python -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 triton==3.6.0 "transformers>=5.20"
  "$VENV/bin/pip" install -q --no-deps -e .
fi
env -u TRITON_INTERPRET "$VENV/bin/python" -m hf_kvcache.kernels.compile_check "$@"
