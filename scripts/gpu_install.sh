#!/usr/bin/env bash
# Installs the wheels of .gpu-wheels/ (made by `make gpu-wheels`: detjac built from this tree, and the zarr, dask,
# gguf, ... that a GPU machine's Python 3.12 lacks) on a machine without network, with no build step, into a
# folder of their own (GPU_SITE, default /tmp/detjac-site), and puts that folder on PYTHONPATH and its bin/ on PATH
# so that `import detjac` and the `detjac` command work with the machine's own python.
#
#   source scripts/gpu_install.sh                 installs, then leaves PYTHONPATH and PATH set in this shell
#   bash scripts/gpu_install.sh -- CMD ARGS...    installs, then runs CMD ARGS... with them set
#
#   GPU_SITE  where the wheels go (default /tmp/detjac-site)
#   PYTHON    the python that installs them and later runs detjac (default: python, else python3)
# A second call with the same wheels skips the install.

_gpu_install() {
    local root wheels site py stamp want
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    wheels="$root/.gpu-wheels"
    site="${GPU_SITE:-/tmp/detjac-site}"
    py="${PYTHON:-$(command -v python || command -v python3)}"
    if [[ -z "$py" ]]; then
        echo "gpu_install.sh: no python on PATH (set PYTHON)" >&2
        return 1
    fi
    if ! compgen -G "$wheels/detjac-*.whl" >/dev/null; then
        echo "gpu_install.sh: no detjac wheel in $wheels: run \`make gpu-wheels\` on a machine with the package index first" >&2
        return 1
    fi
    if [[ "$(cd "$root" && "$py" -m scripts.gpu_source_digest "$root")" != "$(cat "$wheels/detjac-source.sha256" 2>/dev/null)" ]]; then
        echo "gpu_install.sh: the detjac wheel in $wheels was built from other sources than $root: run \`make gpu-wheels\` again" >&2
        return 1
    fi
    stamp="$site/.detjac-gpu-wheels"
    want="$("$py" -c 'import sys; print(sys.executable)')
$(cd "$wheels" && cksum -- *.whl)"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        mkdir -p "$site" || return 1
        "$py" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --upgrade --target "$site" \
            "$wheels"/*.whl || { echo "gpu_install.sh: pip install into $site failed" >&2; return 1; }
        printf '%s' "$want" >"$stamp"
    fi
    case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
    case ":$PATH:" in *":$site/bin:"*) ;; *) export PATH="$site/bin:$PATH" ;; esac
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    # sourced: leave the caller's shell options alone
    if _gpu_install; then
        unset -f _gpu_install
        return 0
    fi
    unset -f _gpu_install
    return 1
fi

set -euo pipefail
_gpu_install
[[ "${1:-}" == "--" ]] && shift
if [[ $# -eq 0 ]]; then
    echo "gpu_install.sh: installed into ${GPU_SITE:-/tmp/detjac-site}; \`source scripts/gpu_install.sh\` sets PYTHONPATH and PATH in a shell, \`bash scripts/gpu_install.sh -- CMD ARGS...\` runs a command with them"
    exit 0
fi
exec "$@"
