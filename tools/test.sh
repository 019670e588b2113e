#!/usr/bin/env bash
# The test command: set up .venv (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
exec .venv/bin/python -m pytest "$@"
