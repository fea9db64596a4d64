#!/usr/bin/env bash
# Smoke test of the image before a rollout: its three binaries run as the image's user
# (65532), on the host's network (loopback ports 11400-12402 and 17500-17501), against a
# scratch directory. The CLI makes a CA and certificates; a controller and two transferds
# start with them (mutual TLS, as deployed); the CLI registers a 64 MiB model from a file
# origin and prewarms it on both hosts; both copies must equal the origin's bytes and be
# owned by the image's user. Everything it starts is stopped on exit.
#
#   deploy/container/smoke.sh [IMAGE]        # default shardcast:0.1.0
#
# ENGINE picks the container engine: docker, podman, or buildah (`buildah run --isolation
# chroot`, for hosts where no OCI runtime can start containers); by default the first of
# docker and podman that runs a container, else buildah. Needs curl and cmp on the host.
set -euo pipefail

image=${1:-shardcast:0.1.0}
work=$(mktemp -d "${TMPDIR:-/tmp}/shardcast-smoke.XXXXXX")
chmod 0777 "$work" # the image's user writes here
started=()         # container IDs (docker, podman) or process IDs (buildah)
buildah_ctr=

say() { printf '== %s\n' "$*"; }
fail() {
    printf 'smoke: FAILED: %s\n' "$*" >&2
    local f id
    for f in "$work"/*.log; do
        [ -e "$f" ] && { printf -- '--- %s (tail)\n' "${f##*/}" >&2; tail -n 15 "$f" >&2; }
    done
    if [ "${engine:-buildah}" != buildah ]; then
        for id in "${started[@]}"; do
            printf -- '--- container %s (tail)\n' "$id" >&2
            "$engine" logs --tail 15 "$id" >&2 2>&1
        done
    fi
    exit 1
}

pick_engine() {
    if [ -n "${ENGINE:-}" ]; then echo "$ENGINE"; return; fi
    local e
    for e in docker podman; do
        if command -v "$e" >/dev/null &&
            timeout 60 "$e" run --rm --network host "$image" shardcast --version >/dev/null 2>&1; then
            echo "$e"
            return
        fi
    done
    command -v buildah >/dev/null && { echo buildah; return; }
    echo "smoke: no container engine can run $image (tried docker, podman, buildah)" >&2
    exit 1
}
engine=$(pick_engine)

cleanup() {
    set +e
    local id
    case $engine in
        buildah)
            # buildah does not pass signals on to what it runs: stop the daemons themselves.
            for id in "${started[@]}"; do kill "$id" 2>/dev/null; done
            for id in "${started[@]}"; do
                for _ in $(seq 1 50); do kill -0 "$id" 2>/dev/null || break; sleep 0.2; done
                kill -9 "$id" 2>/dev/null
            done
            [ -n "$buildah_ctr" ] && buildah rm "$buildah_ctr" >/dev/null
            ;;
        *)
            for id in "${started[@]}"; do
                "$engine" stop -t 10 "$id" >/dev/null 2>&1
                "$engine" rm -f "$id" >/dev/null 2>&1
            done
            ;;
    esac
    rm -rf "$work"
}
trap cleanup EXIT

# run [-d NAME] [--env K=V]... -- COMMAND...: one command in the image (-d: in the
# background, its output in $work/NAME.log).
run() {
    local detach='' envs=()
    while [ "$1" != -- ]; do
        case $1 in
            -d) detach=$2; shift 2 ;;
            --env) envs+=(--env "$2"); shift 2 ;;
        esac
    done
    shift
    case $engine in
        buildah)
            [ -n "$buildah_ctr" ] || buildah_ctr=$(buildah from --quiet "$image")
            local cmd=(buildah run --isolation chroot --network host -v "$work:/w" "${envs[@]}" "$buildah_ctr" -- "$@")
            if [ -n "$detach" ]; then
                "${cmd[@]}" >"$work/$detach.log" 2>&1 &
            else
                "${cmd[@]}"
            fi
            ;;
        *)
            local cmd=("$engine" run --network host -v "$work:/w" "${envs[@]}")
            if [ -n "$detach" ]; then
                started+=("$("${cmd[@]}" -d "$image" "$@")")
            else
                "${cmd[@]}" --rm "$image" "$@"
            fi
            ;;
    esac
}

# The PID listening on a loopback port (buildah: the daemon itself, to stop it).
pid_on() { ss -Hltnp "sport = :$1" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n1 | cut -d= -f2; }

# Whether something listens on a loopback port.
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Waits for a port to listen, up to 30 s; remembers its PID under buildah.
await_port() {
    local port=$1 name=$2
    for _ in $(seq 1 150); do
        if listening "$port"; then
            [ "$engine" = buildah ] && started+=("$(pid_on "$port")")
            return 0
        fi
        sleep 0.2
    done
    fail "$name did not listen on 127.0.0.1:$port within 30 s"
}

for port in 11400 11401 11402 12400 12401 12402 17500 17501; do
    if listening "$port"; then
        fail "127.0.0.1:$port is taken; stop what listens there first"
    fi
done

say "engine $engine, image $image, scratch $work"
run -- shardcast --version
say "certificates (the image's CLI)"
run -- shardcast certs init --dir /w/pki
for n in 1 2; do run -- shardcast certs issue --dir /w/pki --role host --name "node$n"; done
run -- shardcast certs issue --dir /w/pki --role controller --name shardcast-controller
run -- shardcast certs issue --dir /w/pki --role admin --name smoke

# A model: one safetensors file, one F32 tensor of 64 MiB of random bytes.
mkdir -p "$work/models/m1"
header='{"w":{"dtype":"F32","shape":[16777216],"data_offsets":[0,67108864]}}'
while [ $((${#header} % 8)) -ne 0 ]; do header+=' '; done
{
    len=${#header}
    for i in 0 1 2 3 4 5 6 7; do printf '%b' "\\x$(printf %02x $(((len >> (8 * i)) & 255)))"; done
    printf '%s' "$header"
    head -c 67108864 /dev/urandom
} >"$work/models/m1/model.safetensors"
chmod -R a+rX "$work/models"

say "controller and two transferds"
run -d controller --env SHARDCAST_CONTROLLER_LISTEN=127.0.0.1:17500 \
    --env SHARDCAST_CONTROLLER_HTTP=127.0.0.1:17501 --env SHARDCAST_CONTROLLER_STATE=/w/controller \
    --env SHARDCAST_TLS_CA=/w/pki/ca.pem --env SHARDCAST_TLS_CERT=/w/pki/controller-shardcast-controller.pem \
    --env SHARDCAST_TLS_KEY=/w/pki/controller-shardcast-controller.key \
    --env SHARDCAST_ORIGIN_ALLOW=file:///w/models/ -- shardcast-controller
await_port 17500 the controller
for n in 1 2; do
    run -d "transferd$n" --env "SHARDCAST_LISTEN=127.0.0.1:1${n}400" \
        --env "SHARDCAST_AGENT_LISTEN=127.0.0.1:1${n}401" --env "SHARDCAST_ADMIN_LISTEN=127.0.0.1:1${n}402" \
        --env SHARDCAST_CONTROLLER=localhost:17500 --env "SHARDCAST_HOST_ID=node$n" \
        --env "SHARDCAST_MEMORY_DIR=/w/node$n/memory" --env "SHARDCAST_DATA_DIR=/w/node$n/disk" \
        --env SHARDCAST_MEMORY_CAPACITY=1GiB --env SHARDCAST_ORIGIN_ALLOW=file:///w/models/ \
        --env SHARDCAST_TLS_CA=/w/pki/ca.pem --env "SHARDCAST_TLS_CERT=/w/pki/host-node$n.pem" \
        --env "SHARDCAST_TLS_KEY=/w/pki/host-node$n.key" -- transferd
    await_port "1${n}402" "transferd $n"
done

cli() {
    run --env SHARDCAST_CONTROLLER=localhost:17500 --env SHARDCAST_TLS_CA=/w/pki/ca.pem \
        --env SHARDCAST_TLS_CERT=/w/pki/admin-smoke.pem --env SHARDCAST_TLS_KEY=/w/pki/admin-smoke.key \
        -- shardcast "$@"
}
say "both hosts report to the controller"
for i in $(seq 1 30); do
    hosts=$(cli hosts 2>&1) || true
    grep -q '^node1 *up' <<<"$hosts" && grep -q '^node2 *up' <<<"$hosts" && break
    [ "$i" = 30 ] && { echo "$hosts"; fail "the hosts did not both report within 30 s"; }
    sleep 1
done
echo "$hosts"
code=$(curl -s -o /dev/null -w '%{http_code}' --cacert "$work/pki/ca.pem" https://localhost:11402/healthz) || true
[ "$code" = 200 ] || fail "transferd 1's /healthz answered ${code:-nothing}, not 200"

say "register and prewarm on both hosts"
cli register org/smoke file:///w/models/m1 || fail "register"
cli prewarm org/smoke -n 2 || fail "prewarm"
cli status org/smoke

say "the copies"
copies=("$work"/node*/memory/models/*/model.safetensors)
if [ "${#copies[@]}" != 2 ] || [ ! -e "${copies[0]}" ]; then
    fail "expected a copy on each host, found: ${copies[*]}"
fi
for f in "${copies[@]}"; do
    cmp -s "$f" "$work/models/m1/model.safetensors" || fail "$f differs from the origin's file"
    owner=$(stat -c %u:%g "$f")
    [ "$owner" = 65532:65532 ] || fail "$f is owned by $owner, not the image's user 65532"
    echo "$f: the origin's bytes, owner $owner"
done
say "smoke: passed"
