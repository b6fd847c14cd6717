#!/usr/bin/env bash
# Set up (or reuse) the repository's virtual environment, install swapformer (again only when pyproject.toml,
# TORCH_SPEC or the checkout's place changed: scripts/install_once.sh), and run
# `swapformer train` in the current folder with the arguments given (none: the default run, a tiny
# decoder pretrained on the Python standard library, written to ./swapformer-model).
# torch is installed first and pinned so pip takes the CPU wheel instead of resolving a multi-GB
# CUDA build; set TORCH_SPEC (e.g. "torch==2.13.0" from another index) to choose differently.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SWAPFORMER_VENV:-$REPO/.venv}"
source "$REPO/scripts/install_once.sh"
install_swapformer "$VENV" train "$REPO"  # only when the environment does not match the checkout
exec "$VENV/bin/swapformer" train "$@"
