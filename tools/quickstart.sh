#!/usr/bin/env bash
# One command from a fresh clone: set up .venv, compress SmolLM2-135M offline
# with the default recipe, and say where the model and the report are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
OUT=${1:-out/smollm2-135m-compressed}
.venv/bin/compressor run recipes/smollm2-135m.yaml --output "$OUT" --overwrite
