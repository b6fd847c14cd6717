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
