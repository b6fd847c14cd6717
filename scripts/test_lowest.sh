#!/usr/bin/env bash
# The lowest versions pyproject.toml allows, in a second virtual environment (.venv-lowest): every
# dependency at its declared lower bound (scripts/lowest_versions.py), checked, then a bounded part of
# the suite (the dependency contracts, every backend against eager on the three architectures, the
# conversions against transformers' models, the native sparse kernels, cached generation, training of
# each architecture) and the main job, `swapformer train`, on its default corpus for a few steps.
# scripts/test.sh runs this after the main suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SWAPFORMER_LOWEST_VENV:-.venv-lowest}"
source scripts/install_once.sh
install_steps() {  # the constraints come from pyproject.toml alone, which the stamp covers
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" scripts/lowest_versions.py > "$VENV/lowest-versions.txt"
    "$VENV/bin/python" -m pip install -q -c "$VENV/lowest-versions.txt" "${TORCH_SPEC:-torch==2.13.0}"
    "$VENV/bin/python" -m pip install -q -c "$VENV/lowest-versions.txt" -e . "pytest>=8" "hypothesis>=6"
}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
install_once "$VENV" lowest install_steps  # only when the environment does not match the checkout
"$VENV/bin/python" scripts/lowest_versions.py --check
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/compat/test_compat.py tests/compat/test_hf_compat.py tests/cli/test_env.py \
    tests/configuration/test_backends.py tests/conversion/test_hf_parity.py tests/cpu/test_sparse_native.py \
    tests/caches/test_generate.py::test_greedy_steps_equal_uncached_forward \
    tests/caches/test_generate.py::test_static_cache_generates_what_the_dynamic_cache_does \
    tests/training/test_train.py::test_each_architecture_trains_and_writes_a_hub_ready_folder \
    "$@"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
"$VENV/bin/swapformer" train --max-steps 3 --output-dir "$OUT/model"
echo "lowest versions: passed"
