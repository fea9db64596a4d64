#!/usr/bin/env bash
# Prints the path of a uv binary (Astral's Python package installer, from PyPI), installing
# it first when needed. The test venvs (moto for the S3 tests, the Python package with
# PyTorch) are filled with uv instead of pip: the same packages (PyTorch with its CUDA
# wheels, 5.2 GB) took 32 CPU-seconds and 22 s with uv against about 180 CPU-seconds and
# 136 s with pip on the 2-vCPU VM, and CI fills them while cargo builds on both cores
# (docs/BENCHMARKS.md, the CI section of the fourteenth session).
#
#   tests/support/uv.sh     # prints the path; exit 3 (and a line on stderr) when uv cannot
#                           # be had, and the callers fall back to pip
#
# Where it comes from: $UV when it names an executable, else `uv` on PATH, else a copy
# installed with pip into a venv under the Cargo target directory (once; a lock keeps
# two installers from racing). uv reads its own settings, not pip's: behind a package
# mirror set up for pip only, set UV_DEFAULT_INDEX (and UV_NATIVE_TLS for a private CA) as
# well; otherwise uv's installs fail and the callers use pip, as slowly as before.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
if [ -n "${UV:-}" ] && [ -x "$UV" ]; then
    echo "$UV"
    exit 0
fi
if command -v uv >/dev/null 2>&1; then
    command -v uv
    exit 0
fi
venv="$target/tools/uv"
mkdir -p "$target/tools"
exec 9>"$venv.lock"
flock 9
if [ ! -x "$venv/bin/uv" ]; then
    rm -rf "$venv"
    if ! python3 -m venv "$venv" >&2; then
        rm -rf "$venv"
        echo "uv.sh: python3 -m venv failed (is python3-venv installed?); using pip" >&2
        exit 3
    fi
    if ! "$venv/bin/pip" install --quiet --disable-pip-version-check 'uv>=0.5' >&2; then
        rm -rf "$venv"
        echo "uv.sh: pip install uv failed (no package index reachable?); using pip" >&2
        exit 3
    fi
fi
echo "$venv/bin/uv"
