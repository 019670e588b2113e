#!/usr/bin/env bash
# One command from a fresh clone: set up .venv, compress SmolLM2-135M offline
# as a GGUF of llama.cpp's Q3_K_M size planned tensor by tensor, and say where the model and the report are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
OUT=${1:-out/smollm2-135m-q3_k_m}
# A GGUF of llama.cpp's Q3_K_M size, planned tensor by tensor and checked in llama.cpp beside that preset
# (docs/size.md). For narrower FFNs in a Hugging Face folder: recipes/smollm2-135m.yaml.
.venv/bin/compressor run recipes/smollm2-135m-gguf.yaml --output "$OUT" --overwrite
