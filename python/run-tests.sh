#!/usr/bin/env bash
# Runs the Python package's tests against real transferd/controller processes on loopback.
#
#   python/run-tests.sh                 # everything (GPU tests skip without PyTorch + CUDA)
#   python/run-tests.sh -k safe_open    # arguments go to pytest
#   SHARDCAST_TEST_TORCH=1 python/run-tests.sh   # also install PyTorch (large) for the torch tests
#   SHARDCAST_TEST_VLLM=1 python/run-tests.sh    # also install vLLM (with PyTorch: ~9 GB, minutes)
#                                                # for the tests that load through vLLM itself (CPU)
#   python/run-tests.sh --install-only  # only create and fill the venv (tests/support/prepare.sh
#                                       # runs this while the Rust build runs)
#
# Needs Rust (cargo) and python3. Creates python/.venv, installs ./python[test] into it
# (numpy, safetensors, pytest; with uv, tests/support/uv.sh, or pip where uv cannot be
# had), builds the Rust binaries (a no-op when they are fresh) and runs pytest. On a host
# without internet but with numpy, safetensors, pytest (and torch) installed, skip all
# this and run
#   PYTHONPATH=python/src python3 -m pytest python/tests        (add -m gpu for the GPU ones)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SHARDCAST_VENV:-$ROOT/python/.venv}"
install_only=0
if [ "${1:-}" = --install-only ]; then
    install_only=1
    shift
fi

# One installer at a time: tests/support/prepare.sh may be filling the venv in the
# background while this runs.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
# tests/support/venv.sh creates and fills it: with uv where it can be had (PyTorch with a
# fifth of pip's CPU, beside CI's build), with pip otherwise.
pyinstall() { "$ROOT/tests/support/venv.sh" "$VENV" "$@"; }
PY="$VENV/bin/python"
pyinstall "$ROOT/python[test]"
if [ "${SHARDCAST_TEST_TORCH:-0}" = 1 ]; then
    pyinstall torch
fi
if [ "${SHARDCAST_TEST_VLLM:-0}" = 1 ]; then
    echo "installing vLLM into $VENV (about 9 GB with PyTorch; once)" >&2
    pyinstall vllm
fi
exec 9>&-
if [ "$install_only" = 1 ]; then
    exit 0
fi

# The same feature set as the Rust test harness builds the daemons with (workspace, tests),
# so after `cargo nextest run --workspace` this is a no-op instead of a rebuild.
(cd "$ROOT" && cargo build --workspace --tests --bins)
export SHARDCAST_BIN_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/debug"

cd "$ROOT"
exec "$PY" -m pytest python/tests "$@"
