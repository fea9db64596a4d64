#!/bin/bash
# The emulated network alone, loaded as a chain loads it: N hosts built the way
# `shardcast-bench chain --emulate` builds them (one namespace each, a veth to a bridge in a
# switch namespace, a tbf on each host's eth0 and one on its switch port, burst 128 KiB,
# limit 20 ms at the rate), and N-1 simultaneous iperf3 flows h(i) -> h(i+1), each carrying
# SIZE. Prints each flow's time and rate / cap: the floor a chain over the same links and
# cores can reach (no TLS, no hashing, no store).
#
#   sudo N=17 RATE=250mbit SIZE=512M [CC=cubic] bench/scripts/iperf-chain.sh [OUT_DIR]
#
# CC picks the flows' TCP congestion control (iperf3 -C; default: the machine's).
# Needs root, iperf3 and python3. Uses 10.233.77.0/24 inside its own namespaces only (nothing
# leaves the machine); removes its namespaces and stops its iperf3 processes (by PID) on exit.
set -u
N=${N:-17}
RATE=${RATE:-250mbit}
SIZE=${SIZE:-512M}
CC=${CC:-}
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
bits=$(python3 -c "
import re,sys
m=re.fullmatch(r'(\d+)([kmg]?)bit','$RATE'.lower()) or sys.exit('RATE like 250mbit')
print(int(m[1])*{'':1,'k':10**3,'m':10**6,'g':10**9}[m[2]])")
BURST=$(( bits / 8 / 500 > 131072 ? bits / 8 / 500 : 131072 ))
LIMIT=$(( bits / 8 / 50 > 4 * BURST ? bits / 8 / 50 : 4 * BURST ))
P=shcip$$
SW=$P-sw
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  for i in $(seq 0 $((N - 1))); do ip netns del "$P-h$i" 2>/dev/null; done
  ip netns del "$SW" 2>/dev/null
}
trap cleanup EXIT INT TERM
ip netns add "$SW"
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
for i in $(seq 0 $((N - 1))); do
  h=$P-h$i
  ip netns add "$h"
  ip -n "$h" link set lo up
  ip -n "$h" link add eth0 type veth peer name "p$i" netns "$SW"
  ip -n "$h" addr add "10.233.77.$((i + 1))/24" dev eth0
  ip -n "$h" link set eth0 up
  ip -n "$SW" link set "p$i" master br0
  ip -n "$SW" link set "p$i" up
  ip netns exec "$h" tc qdisc add dev eth0 root tbf rate "$RATE" burst "$BURST" limit "$LIMIT"
  ip netns exec "$SW" tc qdisc add dev "p$i" root tbf rate "$RATE" burst "$BURST" limit "$LIMIT"
done
for i in $(seq 1 $((N - 1))); do
  timeout 600 ip netns exec "$P-h$i" iperf3 -s -1 -p 5201 >/dev/null 2>&1 &
  PIDS+=($!)
done
sleep 1
clients=()
for i in $(seq 0 $((N - 2))); do
  timeout 600 ip netns exec "$P-h$i" iperf3 -c "10.233.77.$((i + 2))" -n "$SIZE" ${CC:+-C "$CC"} -J >"$OUT/flow-$i.json" 2>&1 &
  clients+=($!)
  PIDS+=($!)
done
wait "${clients[@]}"
python3 - "$OUT" "$N" "$bits" <<'PY'
import json, sys
out, n, bits = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = []
for i in range(n - 1):
    e = json.load(open(f"{out}/flow-{i}.json"))["end"]["sum_received"]
    rows.append((e["seconds"], e["bits_per_second"] / bits, e["bytes"]))
print("flow seconds ", [round(s, 2) for s, _, _ in rows])
print("rate / cap   ", [round(r, 3) for _, r, _ in rows])
print("slowest flow vs size/rate:", round(max(s / (b * 8 / bits) for s, _, b in rows), 3))
json.dump({"hosts": n, "rate_bits_per_s": bits,
           "flows": [{"seconds": s, "rate_over_cap": r, "bytes": b} for s, r, b in rows]},
          open(f"{out}/summary.json", "w"), indent=1)
PY
