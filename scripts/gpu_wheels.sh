#!/usr/bin/env bash
# Fills .gpu-wheels/ (git-ignored) with what a GPU machine without network needs to run detjac, on top of the
# packages it already has (Python 3.12 with torch, transformers, accelerate, safetensors, numpy, tqdm, click,
# matplotlib, fsspec, pyarrow, xarray, tensorstore and their own dependencies: tokenizers, huggingface_hub, pyyaml,
# packaging, jinja2, typing_extensions, psutil, idna, certifi, pandas, ...):
#   - the cp312 manylinux x86_64 wheels of zarr, numcodecs, crc32c, dask, distributed, gguf and of exactly those of
#     their runtime dependencies (Requires-Dist) that such a machine lacks, pinned below;
#   - a wheel of detjac itself, built from this working tree (its package-dir layout maps detjac to core/ etc., so
#     the repository root on the import path is not enough for `import detjac` there).
# scripts/gpu_install.sh installs them there (pip --no-index --no-deps --target), without building anything.
# bitsandbytes (the `quant` extra) is left out: its wheel is far too large for the transfer, and nothing a GPU
# benchmark run does needs it (detjac imports it only for quantized checkpoints).
# The folder must stay under 30 MiB: the working tree and what travels with it are limited to 64 MiB in all (checked
# at the end, with the tree's files that git does not ignore).
#
# Usage: scripts/gpu_wheels.sh            (or: make gpu-wheels)
#   GPU_WHEELS_PYTHON  the Python whose pip downloads the wheels and builds detjac's (needs setuptools>=68);
#                      default .venv/bin/python, else python3. Any version works: --python-version picks 3.12.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.gpu-wheels"
LIMIT_BYTES=$((30 * 1024 * 1024))
TRAVEL_LIMIT_BYTES=$((64 * 1024 * 1024))

if [[ -n "${GPU_WHEELS_PYTHON:-}" ]]; then
    PY="$GPU_WHEELS_PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
else
    PY="$(command -v python3)"
fi

# The newest releases that support Python 3.12 and meet pyproject.toml's lower bounds.
PINS=(
    # what detjac depends on and the GPU machine lacks
    zarr==3.4.2
    numcodecs==0.17.1
    crc32c==2.9.post0
    dask==2026.8.0
    distributed==2026.8.0
    gguf==0.19.0
    # zarr's
    donfig==0.8.1.post1
    google-crc32c==1.9.0
    msgspec==0.22.0
    # dask's and distributed's (click, fsspec, packaging, pyyaml, jinja2, psutil are there already)
    toolz==1.2.0
    partd==1.4.2
    locket==1.0.0
    cloudpickle==3.1.3
    msgpack==1.2.4
    sortedcontainers==2.4.0
    tblib==3.2.2
    zict==3.0.0
    tornado==6.6.1
    # gguf's requests (transformers 5 no longer brings it; idna and certifi come with httpx)
    requests==2.34.2
    urllib3==2.8.0
    charset-normalizer==3.5.3
)

mkdir -p "$OUT"
echo "Downloading ${#PINS[@]} wheels (cp312, manylinux x86_64) into $OUT"
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --no-deps -d "$OUT" "${PINS[@]}"

# Drop wheels a former pin left behind (the detjac wheel is rebuilt below).
shopt -s nullglob
keep=()
for pin in "${PINS[@]}"; do
    name="${pin%%==*}"
    version="${pin##*==}"
    prefix="${name//-/_}-$version-"
    matches=("$OUT/$prefix"*.whl)
    if [[ ${#matches[@]} -ne 1 ]]; then
        echo "gpu_wheels.sh: expected one wheel $prefix*.whl in $OUT, found ${#matches[@]}" >&2
        exit 1
    fi
    keep+=("$(basename "${matches[0]}")")
done
for whl in "$OUT"/*.whl; do
    base="$(basename "$whl")"
    if [[ "$base" == detjac-* ]]; then
        rm -f -- "$whl"
        continue
    fi
    stale=1
    for k in "${keep[@]}"; do
        [[ "$base" == "$k" ]] && { stale=0; break; }
    done
    if [[ $stale -eq 1 ]]; then
        echo "removing $base (not pinned)"
        rm -f -- "$whl"
    fi
done

echo "Building detjac's wheel from $ROOT"
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$OUT" "$ROOT"
detjac_wheels=("$OUT"/detjac-*.whl)
if [[ ${#detjac_wheels[@]} -ne 1 ]]; then
    echo "gpu_wheels.sh: detjac's wheel was not built into $OUT" >&2
    exit 1
fi
# the sources it was built from: gpu_install.sh refuses a wheel built from other code than the tree it runs in
(cd "$ROOT" && "$PY" -m scripts.gpu_source_digest "$ROOT") >"$OUT/detjac-source.sha256"

ls -l "$OUT"/*.whl | awk '{printf "%10d  %s\n", $5, $NF}' | sed "s|$OUT/||"
total=$(find "$OUT" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
awk -v t="$total" -v n="$(find "$OUT" -type f | wc -l)" \
    'BEGIN {printf "total: %d bytes (%.1f MiB) in %d files; limit 30 MiB\n", t, t / 1048576, n}'
if ((total > LIMIT_BYTES)); then
    echo "gpu_wheels.sh: $OUT holds more than 30 MiB" >&2
    exit 1
fi
# What travels to the GPU machine: the working tree's files that git does not ignore, and these wheels.
tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c '%s' 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
awk -v t="$tree" -v w="$total" 'BEGIN {printf "travels: the tree %.1f MiB + the wheels %.1f MiB = %.1f MiB; limit 64 MiB\n",
    t / 1048576, w / 1048576, (t + w) / 1048576}'
if ((tree + total > TRAVEL_LIMIT_BYTES)); then
    echo "gpu_wheels.sh: the tree and the wheels hold more than 64 MiB; the largest files of the tree:" >&2
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c '%s %n' 2>/dev/null \
        | sort -rn | head -5) >&2
    exit 1
fi
