#!/usr/bin/env bash
# Wheels the GPU check carries to a machine with no package registry (.whl/, ignored by git): hf-kvcache itself and
# the transformers release the project supports (that machine's own transformers is older).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir -p .whl
python -m pip wheel -q --no-deps --no-build-isolation . -w .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "transformers==$(python -c 'import transformers; print(transformers.__version__)')"
ls -la .whl
