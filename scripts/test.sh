#!/usr/bin/env bash
# Set up (or reuse) a virtual environment and run the test suite. Extra arguments go to pytest.
# torch is installed first and pinned so pip takes the CPU wheel instead of resolving a multi-GB
# CUDA build; set TORCH_SPEC (e.g. "torch==2.13.0" from another index) to choose differently.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SWAPFORMER_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
exec "$VENV/bin/python" -m pytest -q --durations=10 "$@"
