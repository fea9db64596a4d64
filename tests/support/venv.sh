#!/usr/bin/env bash
# Creates the virtual environment VENV when it has no python yet and installs PACKAGEs into
# it: with uv (tests/support/uv.sh) where it can be had, with `python3 -m venv` and pip
# otherwise, and with pip again for whatever uv fails to install (uv reads its own index
# settings, not pip's). On Debian as root it installs python3-venv when `python3 -m venv`
# needs it. The callers hold their own lock.
#
#   tests/support/venv.sh VENV PACKAGE...
#
# Exit status 3 (and a line on stderr) when the venv cannot be created or filled.
set -euo pipefail
venv="${1:?usage: venv.sh VENV PACKAGE...}"
shift
here="$(cd "$(dirname "$0")" && pwd)"
target="${CARGO_TARGET_DIR:-$here/../../target}"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$target/uv-cache}" UV_PYTHON_DOWNLOADS=never
uv="$("$here/uv.sh")" || uv=
if [ ! -x "$venv/bin/python" ]; then
    rm -rf "$venv"
    # --seed: pip in a venv uv creates too, for the fall-back below and for people.
    if [ -z "$uv" ] || ! "$uv" venv --quiet --seed --python "$(command -v python3)" "$venv" >&2; then
        rm -rf "$venv"
        if ! python3 -m venv "$venv" >&2 2>/dev/null; then
            rm -rf "$venv"
            # Debian/Ubuntu ship venv's ensurepip separately.
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
                echo "venv.sh: python3 -m venv failed: installing python3-venv" >&2
                apt-get update -qq
                ver="$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
                DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "python${ver}-venv" >&2 \
                    || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >&2
            fi
            if ! python3 -m venv "$venv" >&2; then
                rm -rf "$venv"
                echo "venv.sh: python3 -m venv failed; install python3-venv (apt-get install python3-venv)" >&2
                exit 3
            fi
        fi
    fi
fi
if [ -n "$uv" ] && "$uv" pip install --quiet --python "$venv/bin/python" "$@" >&2; then
    exit 0
fi
[ -z "$uv" ] || echo "venv.sh: uv could not install $*; trying pip" >&2
if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >&2; then
    echo "venv.sh: pip install $* failed (no package index reachable?)" >&2
    exit 3
fi
