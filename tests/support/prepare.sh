#!/usr/bin/env bash
# Installs, side by side, what the tests install on first use: moto into a venv under the
# target directory (tests/support/s3-server.sh), s3rver with npm (tests/support/s3rver.sh)
# and the Python package's venv (python/run-tests.sh --install-only). scripts/test and
# .ci/run start this in the background while cargo builds, so the downloads overlap the
# compile instead of sitting inside the tests; each installer takes a lock, so a test
# that gets there first waits for it instead of installing twice. Where an installer
# cannot work (no python3, npm or package index), it says so here and the tests that need
# it skip with the reason (listed at the end of scripts/test).
#
#   tests/support/prepare.sh        # logs under target/prepare/
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
logs="$target/prepare"
mkdir -p "$logs"
pids=() names=()
run() {
    local name=$1
    shift
    "$@" >"$logs/$name.log" 2>&1 &
    pids+=($!)
    names+=("$name")
}
run moto bash "$here/s3-server.sh" install
run s3rver bash "$here/s3rver.sh" install
run python-venv bash "$root/python/run-tests.sh" --install-only
failed=0
for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "prepare: ${names[$i]} could not be installed (log: $logs/${names[$i]}.log):" >&2
        sed 's/^/    /' "$logs/${names[$i]}.log" >&2
        failed=1
    fi
done
exit "$failed"
