# Sourced by scripts/train.sh, test.sh and test_lowest.sh, which run under `set -e`.
#
# install_once VENV NAME STEPS: run the shell function STEPS (the script's install commands) unless VENV
# already holds what this checkout asks for. A stamp, VENV/.swapformer-NAME-installed, is written after STEPS
# succeed and holds what the install depends on: the checkout's path (an editable install points there),
# pyproject.toml, the build backend, the lowest-versions script, the steps themselves and TORCH_SPEC. Any
# change installs again; so does a new environment (no stamp) or SWAPFORMER_REINSTALL=1 (after changing the
# environment by hand). The stamp is removed before installing, so a failed install leaves none.
install_once() {
    local venv="$1" name="$2" steps="$3"
    local stamp="$venv/.swapformer-$name-installed" wanted
    wanted="$(install_inputs "$steps")"
    if [ "${SWAPFORMER_REINSTALL:-0}" = 0 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
        return 0
    fi
    rm -f "$stamp"
    "$steps"
    printf '%s\n' "$wanted" > "$stamp"
}

install_inputs() {
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    printf 'checkout %s\nTORCH_SPEC=%s\n' "$root" "${TORCH_SPEC:-}"
    declare -f "$1"
    (cd "$root" && cksum pyproject.toml scripts/build_backend.py scripts/lowest_versions.py)
}

# install_swapformer VENV NAME TARGET: the environment VENV (made when missing) with pip upgraded, torch
# (TORCH_SPEC; default torch==2.13.0, whose CPU wheel pip takes instead of resolving a multi-GB CUDA build)
# and `pip install -e TARGET`, through install_once under NAME.
install_swapformer() {
    INSTALL_VENV="$1" INSTALL_TARGET="$3"
    [ -x "$INSTALL_VENV/bin/python" ] || python3 -m venv "$INSTALL_VENV"
    install_once "$INSTALL_VENV" "$2" swapformer_steps
}

swapformer_steps() {
    "$INSTALL_VENV/bin/python" -m pip install -q --upgrade pip
    "$INSTALL_VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
    "$INSTALL_VENV/bin/python" -m pip install -q -e "$INSTALL_TARGET"
}
