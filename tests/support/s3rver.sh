#!/usr/bin/env bash
# Starts s3rver (https://www.npmjs.com/package/s3rver), a Node.js S3-compatible server that
# keeps each object in a file, on ADDR:PORT (ADDR defaults to 127.0.0.1) with its data under
# DIR: the `origin` benchmark's second S3 server (moto answers every ranged GET by copying
# the whole object, so it measures moto, not the link: docs/BENCHMARKS.md). Installs a
# pinned s3rver with npm under the Cargo target directory on first use (later runs reuse
# it), then replaces itself with the server, so the caller's child PID is the server's and
# can be killed by PID. `install` only installs (the server may then start in a network
# namespace with no route to the registry).
#
#   tests/support/s3rver.sh PORT DIR [ADDR]
#   tests/support/s3rver.sh install
#
# Credentials: access key S3RVER, secret S3RVER (s3rver checks the SigV4 signature of every
# request against them). Exit status 3 (and a line on stderr) when node or npm are missing.
set -euo pipefail
port="${1:?usage: s3rver.sh PORT DIR [ADDR] | install}"
here="$(cd "$(dirname "$0")" && pwd)"
target="${CARGO_TARGET_DIR:-$here/../../target}"
prefix="$target/s3rver"
bin="$prefix/node_modules/.bin/s3rver"
if ! command -v node >/dev/null 2>&1; then
    echo "s3rver.sh: node not found" >&2
    exit 3
fi
if [ ! -x "$bin" ]; then
    if ! command -v npm >/dev/null 2>&1; then
        echo "s3rver.sh: npm not found" >&2
        exit 3
    fi
    mkdir -p "$target"
    exec 9>"$target/s3rver.lock"
    flock 9
    if [ ! -x "$bin" ]; then
        rm -rf "$prefix"
        mkdir -p "$prefix"
        if ! npm install --no-audit --no-fund --silent --prefix "$prefix" s3rver@3.7.1 >&2; then
            rm -rf "$prefix"
            echo "s3rver.sh: npm install s3rver failed (no package registry reachable?)" >&2
            exit 3
        fi
    fi
    exec 9>&-
fi
if [ "$port" = install ]; then
    exit 0
fi
dir="${2:?usage: s3rver.sh PORT DIR [ADDR]}"
addr="${3:-127.0.0.1}"
mkdir -p "$dir"
# -s: no log line per request (it costs the server CPU the benchmark measures).
exec "$bin" -d "$dir" -a "$addr" -p "$port" -s
