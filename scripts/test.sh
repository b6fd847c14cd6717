#!/usr/bin/env bash
# Set up (or reuse) a virtual environment (installing again only when pyproject.toml, TORCH_SPEC or the
# checkout's place changed: scripts/install_once.sh) and run the test suite with the newest releases pip
# resolves, then (with no arguments) the lowest versions pyproject.toml allows (scripts/test_lowest.sh).
# Extra arguments go to pytest and run the main suite only.
# torch is installed first and pinned so pip takes the CPU wheel instead of resolving a multi-GB
# CUDA build; set TORCH_SPEC (e.g. "torch==2.13.0" from another index) to choose differently.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SWAPFORMER_VENV:-.venv}"
source scripts/install_once.sh
install_swapformer "$VENV" test ".[dev]"  # only when the environment does not match the checkout
"$VENV/bin/python" -m pytest -q --durations=10 "$@"
# With no arguments (the full suite, as .ci/run runs it) the lowest versions pyproject.toml allows are
# tested too, in a second environment; SWAPFORMER_LOWEST=0 skips that.
if [ $# -eq 0 ] && [ "${SWAPFORMER_LOWEST:-1}" != 0 ]; then
    bash scripts/test_lowest.sh
fi
