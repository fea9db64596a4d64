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
        if ! "$here/venv.sh" "$venv" 'moto[server]>=5,<6'; then
            rm -rf "$venv"
            echo "s3-server.sh: moto[server] could not be installed (above)" >&2
            exit 3
        fi
    fi
    exec 9>&-
fi
if [ "$port" = install ]; then
    exit 0
fi
exec "$venv/bin/moto_server" -H "$host" -p "$port"
