#!/usr/bin/env bash
# Issue #28's many-core and GPU checks, run on a lent device machine (16 cores, one GPU) as
# one prepared script. Build here first, then carry `.dev/`:
#
#   cargo build --release -p transferd -p shardcast-bench -p shardcast-controller \
#       -p shardcast-identity --bins --examples
#   bench/scripts/device-issue28.sh pack      # stripped, gzipped binaries + iperf3 into .dev/
#   # (.dev/ is ignored: name it in the device run's carry)
#   # on the device, from the repository root, with $OUT set:
#   bench/scripts/device-issue28.sh run [targets|lanes|quic|hop|loader|all|writers|next|sends|threads|auto|fresh|s44|reserve|s45]
#
# Every report is JSON under $OUT; the machine's description goes to $OUT/machine.txt.
set -u
dev=${DEV_DIR:-.dev}

pack() {
    set -e
    rm -rf "$dev" && mkdir -p "$dev/lib"
    for b in transferd shardcast-bench shardcast-controller examples/file_write_rate examples/data_path_rate; do
        [ -x "target/release/$b" ] || {
            echo "pack: target/release/$b is missing; build first: cargo build --release -p transferd -p shardcast-bench -p shardcast-controller -p shardcast-identity --bins --examples" >&2
            exit 1
        }
        strip -o "$dev/${b##*/}" "target/release/$b"
        gzip -6 "$dev/${b##*/}"
    done
    # Optional: the QUIC stacks side by side (`run quic`), when built:
    # (cd bench/experiments/quic-impls && cargo build --release)
    q=bench/experiments/quic-impls/target/release/quic-impls
    if [ -x "$q" ]; then
        strip -o "$dev/quic-impls" "$q" && gzip -6 "$dev/quic-impls"
    else
        echo "pack: $q not built; \`run quic\` will be unavailable" >&2
    fi
    # iperf3 for the raw-TCP baseline of the same run (the device has no package registry).
    if ! command -v iperf3 >/dev/null; then
        echo "pack: iperf3 is not installed here; installing it (Debian's package)" >&2
        apt-get install -y iperf3 >/dev/null 2>&1 ||
            { apt-get update >/dev/null 2>&1 && apt-get install -y iperf3 >/dev/null 2>&1; } ||
            { echo "pack: cannot install iperf3; the raw-TCP baseline needs it" >&2; exit 1; }
    fi
    cp "$(command -v iperf3)" "$dev/iperf3"
    for l in libiperf.so.0 libsctp.so.1; do
        cp -L "/lib/x86_64-linux-gnu/$l" "$dev/lib/"
    done
    du -sh "$dev"
}

run() {
    what=${1:-all}
    : "${OUT:?set OUT to the folder the reports go to}"
    bin=/tmp/shardcast-bin
    mkdir -p "$bin"
    for b in transferd shardcast-bench shardcast-controller file_write_rate data_path_rate; do
        gzip -dc "$dev/$b.gz" >"$bin/$b" && chmod +x "$bin/$b"
    done
    if [ -f "$dev/quic-impls.gz" ]; then
        gzip -dc "$dev/quic-impls.gz" >"$bin/quic-impls" && chmod +x "$bin/quic-impls"
    fi
    cp "$dev/iperf3" "$bin/" && chmod +x "$bin/iperf3"
    export PATH="$bin:$PATH" LD_LIBRARY_PATH="$PWD/$dev/lib"
    export SHARDCAST_TRANSFERD="$bin/transferd" SHARDCAST_CONTROLLER_BIN="$bin/shardcast-controller"
    {
        date -u
        uname -a
        nproc
        grep -m1 'model name' /proc/cpuinfo
        free -g | head -2
        df -h /dev/shm | tail -1
        echo "tcp ulp: $(cat /proc/sys/net/ipv4/tcp_available_ulp 2>/dev/null)"
        nvidia-smi -L 2>/dev/null
        iperf3 --version | head -1
    } >"$OUT/machine.txt" 2>&1
    cat "$OUT/machine.txt"
    bench="$bin/shardcast-bench"
    hop_size=${HOP_SIZE:-4GiB}
    summary() { # the figures that matter, one line each (fails when the step wrote no report)
        [ -s "$1" ] || return 1
        python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if "runs" in r:
    raw = r.get("raw_tcp_bytes_per_s")
    print(f"raw tcp {raw and raw/1e9:.2f} GB/s" if raw else "raw tcp: no iperf3")
    for x in r["runs"]:
        print(f"{x['config']:>20} {x['bytes_per_s']/1e9:6.2f} GB/s  src {x['source_cpu_s_per_gb']:.2f} + recv {x['receiver_cpu_s_per_gb']:.2f} cpu-s/GB  util {x.get('cpu_util')}")
else:
    for k, v in r.items():
        if not isinstance(v, (dict, list)):
            print(f"{k}: {v}")
PY
    }
    step() { # name, limit in seconds, arguments…
        local name=$1 limit=$2
        shift 2
        local t0=$SECONDS
        echo "== $name: shardcast-bench $*"
        echo "== $name: shardcast-bench $*" >>"$OUT/log.txt"
        timeout "$limit" "$bench" "$@" --json "$OUT/$name.json" >>"$OUT/log.txt" 2>&1
        local rc=$?
        summary "$OUT/$name.json" || tail -c 800 "$OUT/log.txt" | tr '\r' '\n' | tail -6
        echo "== $name: exit $rc after $((SECONDS - t0)) s"
    }
    chain() { # name, data mode, stripes, writer, scratch dir, more arguments of `chain`…
        local name=$1 mode=$2 stripes=$3 writer=$4 scratch=$5
        shift 5
        mkdir -p "$OUT/chain"
        SHARDCAST_BENCH_SCRATCH=$scratch timeout 120 "$bench" chain --local --receivers 1 --size "$hop_size" \
            --methods chain-tcp --warm-up --data-mode "$mode" --stripes "$stripes" \
            --daemon-arg=--writer --daemon-arg="$writer" "$@" --json "$OUT/chain/$name.json" >>"$OUT/log.txt" 2>&1
        python3 - "$OUT/chain/$name.json" "$name" <<'PY' || echo "$name: failed"
import json, sys
r = json.load(open(sys.argv[1])); x = r["results"][0]; gb = r["bytes"] / 1e9
print(f"{sys.argv[2]:>28} {r['bytes']/x['completion_s']/1e9:6.2f} GB/s  src {x['source_cpu_s']/gb:.2f} + recv {x['receiver_cpu_s'][0]/gb:.2f} cpu-s/GB  util {x['cpu_util']:.2f} verified {x['verified']}")
PY
    }
    chain_quic() { # name, shards, QUIC connections per peer, more arguments of `chain`…
        local name=$1 shards=$2 lanes=$3
        shift 3
        mkdir -p "$OUT/chain"
        timeout 120 "$bench" chain --local --receivers 1 --size "$hop_size" --shards "$shards" \
            --methods chain-quic --warm-up --daemon-arg=--quic-connections --daemon-arg="$lanes" \
            "$@" --json "$OUT/chain/$name.json" >>"$OUT/log.txt" 2>&1
        python3 - "$OUT/chain/$name.json" "$name" <<'PY' || echo "$name: failed"
import json, sys
r = json.load(open(sys.argv[1])); x = r["results"][0]; gb = r["bytes"] / 1e9
print(f"{sys.argv[2]:>28} {r['bytes']/x['completion_s']/1e9:6.2f} GB/s  src {x['source_cpu_s']/gb:.2f} + recv {x['receiver_cpu_s'][0]/gb:.2f} cpu-s/GB  util {x['cpu_util']:.2f} verified {x['verified']}")
PY
    }
    hops() { # the hop, one shard, over one connection and striped over eight
        step hop-${hop_size}-stripes1 150 hop --size "$hop_size"
        step hop-${hop_size}-stripes8 150 hop --size "$hop_size" --stripes 8
    }
    huge=/mnt/shm-huge
    if [ "$what" = writers ]; then
        mkdir -p $huge && mount -t tmpfs -o size=96G,huge=within_size tmpfs $huge || huge=
        echo "huge-page tmpfs: ${huge:-none}"
        for cfg in "tls 8 pwrite" "tls 8 mapped" "tls 1 mapped" "tls 16 mapped" "authenticate-only 8 mapped" \
            "authenticate-only 1 mapped" "tls 1 pwrite"; do
            set -- $cfg
            chain "shm-$1-s$2-$3" "$1" "$2" "$3" /dev/shm
        done
        echo "== file write rate, /dev/shm then the huge-page tmpfs (GiB/s)"
        "$bin/file_write_rate" /dev/shm 2 1,2,4,8,16 | tee -a "$OUT/log.txt"
        [ -n "$huge" ] && "$bin/file_write_rate" "$huge" 2 1,2,4,8,16 | tee -a "$OUT/log.txt"
        if [ -n "$huge" ]; then
            step loader-huge-streamed-8GiB 90 loader --backend cuda --gpus 1 --size 8GiB \
                --net-rate 200GB/s --model-dir "$huge"
            step loader-huge-register-ahead-8GiB 90 loader --backend cuda --gpus 1 --size 8GiB \
                --net-rate 200GB/s --register-ahead --model-dir "$huge"
            for cfg in "tls 8 mapped" "tls 8 pwrite" "authenticate-only 1 mapped" "tls 1 mapped"; do
                set -- $cfg
                chain "huge-$1-s$2-$3" "$1" "$2" "$3" "$huge"
            done
        fi
        (cd "$OUT" && tar czf chain-json.tar.gz chain && rm -r chain)
        [ -n "$huge" ] && umount "$huge"
    fi
    if [ "$what" = next ]; then
        # What the 2026-11-27 session built after its device time was spent: the record
        # layer (identity::records), the adaptive writer as the default, QUIC lanes.
        echo "== one data connection, rustls's stream vs the record layer (4 GiB, 3 rounds)"
        "$bin/data_path_rate" 4 3 | tee -a "$OUT/log.txt"
        hops
        for lanes in 1 4 8; do
            chain_quic "quic-shards8-lanes$lanes" 8 "$lanes"
        done
        # The adaptive writer (the default since 2026-11-26) next to pwrite and the map.
        for cfg in "tls 1 adaptive" "tls 8 adaptive" "authenticate-only 1 adaptive" \
            "authenticate-only 8 adaptive"; do
            set -- $cfg
            chain "shm-$1-s$2-$3" "$1" "$2" "$3" /dev/shm
        done
        (cd "$OUT" && tar czf chain-json.tar.gz chain && rm -r chain)
        # The loader's baseline on this card, for the streamed-load work that follows.
        step loader-streamed-8GiB 90 loader --backend cuda --gpus 1 --size 8GiB --net-rate 200GB/s
        step loader-streamed-8GiB-net25 90 loader --backend cuda --gpus 1 --size 8GiB --net-rate 25GB/s
    fi
    if [ "$what" = threads ]; then
        # Which threads of an unstriped hop are busy (no perf on the device): /proc per
        # thread, every half second, while one 4 GiB shard crosses the hop.
        for mode in tls authenticate-only; do
            echo "== threads of a $mode hop, 1 stripe, 4 GiB"
            python3 bench/scripts/thread_cpu.py "transferd --host-id" 0.5 -- \
                "$bench" chain --local --receivers 1 --size "$hop_size" --methods chain-tcp \
                --warm-up --data-mode "$mode" --json "$OUT/threads-$mode.json" 2>>"$OUT/log.txt" |
                grep -A9 "(pid" | tee -a "$OUT/threads.txt"
        done
    fi
    if [ "$what" = auto ]; then
        # What the 2026-11-28 sessions made depend on the core count, measured where it
        # matters: `stripes = auto` (8 connections for one shard on 16 cores, 4 each for
        # two), `hash_on_read` (auto: off from 8 cores) both ways, and one async worker
        # against one per core (`worker_threads`).
        for cfg in "1 true" "1 false" "auto true" "auto false"; do
            set -- $cfg
            chain "shm-tls-s$1-hor-$2" tls "$1" adaptive /dev/shm \
                --daemon-arg=--hash-on-read --daemon-arg="$2"
        done
        chain "shm-tls-sauto-shards2" tls auto adaptive /dev/shm --shards 2
        chain "shm-tls-sauto-workers1" tls auto adaptive /dev/shm \
            --daemon-arg=--worker-threads --daemon-arg=1
        chain "shm-tls-s1-workers1" tls 1 adaptive /dev/shm \
            --daemon-arg=--worker-threads --daemon-arg=1
        (cd "$OUT" && tar czf chain-json.tar.gz chain && rm -r chain)
        hops
    fi
    if [ "$what" = fresh ] || [ "$what" = s44 ]; then
        # A load streamed into fresh mappings (2026-11-28): pinning them as it copies (the
        # default) against copying them through the staging ring (`--fresh stage`) with
        # more fill threads and larger buffers; the first load after registering ahead.
        lstep() { # name, net rate, more arguments of `loader`…
            local name=$1 rate=$2
            shift 2
            step "loader-$name" 60 loader --backend cuda --gpus 1 --size 8GiB --net-rate "$rate" "$@"
        }
        lstep register-200 200GB/s
        lstep stage-f4-8x4M-200 200GB/s --fresh stage
        lstep stage-f8-16x16M-200 200GB/s --fresh stage --fill-threads 8 --staging-buffers 16 --staging-size 16MiB
        lstep stage-f12-16x16M-200 200GB/s --fresh stage --fill-threads 12 --staging-buffers 16 --staging-size 16MiB
        lstep stage-f8-32x8M-200 200GB/s --fresh stage --fill-threads 8 --staging-buffers 32 --staging-size 8MiB
        lstep register-ahead-200 200GB/s --register-ahead
        lstep register-25 25GB/s
        lstep stage-f8-16x16M-25 25GB/s --fresh stage --fill-threads 8 --staging-buffers 16 --staging-size 16MiB
        python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "loader-*.json"))):
    r = json.load(open(f)); st = {s["stage"]: s["seconds"] for s in r["stages"]}
    pr = r.get("pipeline_report") or {}
    bound = max(st.values())
    print(f"{os.path.basename(f):>42} pipeline {r['pipeline_s']:.3f} s  bound {bound:.3f} ({'/'.join(f'{k} {v:.3f}' for k, v in st.items())})  x{r['pipeline_s']/bound:.2f}  path {pr.get('host_path')}  ahead {r.get('register_ahead_s')}  first {(r.get('cuda') or {}).get('first_load_ratio')}")
PY
    fi
    if [ "$what" = s44 ]; then
        bash "$0" run auto
    fi
    if [ "$what" = targets ]; then
        # Issue #28's benchmarks 1-3 and 5, nothing else, in one call (under 9 minutes of
        # limits): 1. the hop, TLS and authenticate-only against iperf3, CPU per GB;
        # 2. one shard striped over 8 connections; 3. QUIC with 1 shard (in 1) and with 8;
        # 5. a streamed load into fresh mappings, and the first load after register-ahead.
        step hop-${hop_size}-stripes1 150 hop --size "$hop_size"
        step hop-${hop_size}-stripes8 150 hop --size "$hop_size" --stripes 8
        step hop-${hop_size}-shards8 150 hop --size "$hop_size" --shards 8
        step loader-streamed-fresh-8GiB 60 loader --backend cuda --gpus 1 --size 8GiB --net-rate 200GB/s
        step loader-register-ahead-8GiB 60 loader --backend cuda --gpus 1 --size 8GiB --net-rate 200GB/s --register-ahead
    fi
    if [ "$what" = lanes ]; then
        # Item 3 with QUIC at its best on many cores: one shard, then eight shards over 1, 4
        # and 8 connections to the peer (`quic_connections`; one connection is one driver
        # task, 0.6-0.7 GB/s on 16 cores in the sixth session). Compare with the TLS hop of
        # `run targets` (hop-*-stripes1 / -shards8).
        chain_quic quic-shards1-lanes1 1 1
        # One shard striped over eight streams, one per connection: item 3's one-shard case
        # with QUIC on as many cores as the TLS hop's eight stripes.
        chain_quic quic-shards1-stripes8-lanes8 1 8 --stripes 8
        for lanes in 1 4 8; do
            chain_quic "quic-shards8-lanes$lanes" 8 "$lanes"
        done
        # Jumbo packets, as the hop's quic-jumbo run (loopback carries them as they are).
        chain_quic quic-jumbo-shards1-lanes1 1 1 --daemon-arg=--quic-path-mtu --daemon-arg=8972
        chain_quic quic-jumbo-shards8-lanes8 8 8 --daemon-arg=--quic-path-mtu --daemon-arg=8972
        (cd "$OUT" && tar czf chain-quic-json.tar.gz chain && rm -r chain)
    fi
    if [ "$what" = quic ]; then
        # quinn, s2n-quic and rustls over TCP, one stream each on loopback, 1500-byte
        # packets (docs/BENCHMARKS.md, 2026-12-03): does another QUIC stack use more cores?
        [ -x "$bin/quic-impls" ] || { echo "quic: quic-impls was not packed" >&2; return 1; }
        timeout 240 "$bin/quic-impls" run --rounds 2 --size 4GiB --json "$OUT/quic-impls-mtu1500.json" 2>&1 | tee "$OUT/quic-impls.txt"
    fi
    if [ "$what" = sends ]; then
        # The default since 2026-11-27 sends chunks down a chain without re-hashing them
        # (`reverify_sends = false`); the hop's second row re-hashes, as before.
        hops
    fi
    if [ "$what" = reserve ] || [ "$what" = s45 ]; then
        # The memory reserve on 16 cores: the hop with spares filled before the run (the
        # bench's default, auto) and without (transferd's default), alternating.
        for r in auto off; do
            step hop-${hop_size}-stripes1-reserve-$r 200 hop --size "$hop_size" --memory-reserve $r
            step hop-${hop_size}-stripes8-reserve-$r 200 hop --size "$hop_size" --stripes 8 --memory-reserve $r
        done
    fi
    if [ "$what" = hop ] || [ "$what" = all ]; then
        hops
        step hop-${hop_size}-shards8 150 hop --size "$hop_size" --shards 8
    fi
    if [ "$what" = loader ] || [ "$what" = all ]; then
        step loader-streamed-8GiB 90 loader --backend cuda --gpus 1 --size 8GiB --net-rate 200GB/s
        step loader-register-ahead-8GiB 90 loader --backend cuda --gpus 1 --size 8GiB \
            --net-rate 200GB/s --register-ahead
    fi
}

case "${1:-}" in
pack) pack ;;
run) run "${2:-all}" ;;
*)
    echo "usage: $0 pack | run [targets|lanes|quic|hop|loader|all|writers|next|sends|threads|auto|fresh|s44|reserve|s45]" >&2
    exit 2
    ;;
esac
