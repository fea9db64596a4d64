#!/usr/bin/env bash
# Starts moto's S3-compatible server (https://pypi.org/project/moto/) on HOST:PORT (HOST
# defaults to 127.0.0.1) for the s3:// origin tests and the `origin` benchmark. Creates a
# virtual environment under the Cargo target directory and installs `moto[server]` into it
# on first use (with uv, tests/support/uv.sh, or pip where uv cannot be had; later runs
# reuse it), then replaces itself with the server, so the caller's
# child PID is the server's and can be killed by PID. `install` only installs (the
# benchmark runs it before starting the server in a network namespace, which has no route
# to the package index).
#
#   tests/support/s3-server.sh PORT [HOST]
#   tests/support/s3-server.sh install
#
# Exit status 3 (and a line on stderr) when python3 or pip are unavailable: the tests print
# that reason and skip.
set -euo pipefail
port="${1:?usage: s3-server.sh PORT [HOST] | install}"
host="${2:-127.0.0.1}"
here="$(cd "$(dirname "$0")" && pwd)"
target="${CARGO_TARGET_DIR:-$here/../../target}"
venv="$target/s3-test-venv"
if ! command -v python3 >/dev/null 2>&1; then
    echo "s3-server.sh: python3 not found" >&2
    exit 3
fi
if [ ! -x "$venv/bin/moto_server" ]; then
    # One installer at a time when several tests start servers at once.
    mkdir -p "$target"
    exec 9>"$target/s3-test-venv.lock"
    flock 9
    if [ ! -x "$venv/bin/moto_server" ]; then
        rm -rf "$venv"
        # uv when it can be had (tests/support/uv.sh: a fifth of pip's CPU), else pip.
        if uv="$("$here/uv.sh")" \
            && UV_PYTHON_DOWNLOADS=never "$uv" venv --quiet --python "$(command -v python3)" "$venv" >&2 \
            && UV_CACHE_DIR="${UV_CACHE_DIR:-$target/uv-cache}" "$uv" pip install --quiet \
                --python "$venv/bin/python" 'moto[server]>=5,<6' >&2; then
            :
        else
            rm -rf "$venv"
            if ! python3 -m venv "$venv" >&2; then
                echo "s3-server.sh: python3 -m venv failed (is the venv module installed?)" >&2
                exit 3
            fi
            if ! "$venv/bin/pip" install --quiet --disable-pip-version-check 'moto[server]>=5,<6' >&2; then
                rm -rf "$venv"
                echo "s3-server.sh: pip install 'moto[server]' failed (no package index reachable?)" >&2
                exit 3
            fi
        fi
    fi
    exec 9>&-
fi
if [ "$port" = install ]; then
    exit 0
fi
exec "$venv/bin/moto_server" -H "$host" -p "$port"
