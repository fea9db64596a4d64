#!/usr/bin/env bash
# A/B: the QUIC chain at ${1}% loss, alternating base and rtt builds; per run: rc, completion, setup and live stalls.
cd /work/main; export SHARDCAST_CONTROLLER_BIN=$PWD/target/release/shardcast-controller SHARDCAST_BENCH_KEEP=1
loss=${1:-10}; n=${2:-10}
for i in $(seq 1 $n); do for b in base rtt; do
  export SHARDCAST_TRANSFERD=/work/bins/transferd-$b
  timeout 100 target/release/shardcast-bench chain --emulate --receivers 3 --size 16MiB --shards 2 --rate 200Mbit --loss $loss --methods chain-quic --timeout-s 30 --json /work/s18/ab-$b-$loss-$i.json > /work/s18/ab-$b-$loss-$i.log 2>&1; rc=$?
  d=$(grep -o 'keeping [^ ]*' /work/s18/ab-$b-$loss-$i.log | cut -d' ' -f2)
  setup=$(cat $d/*/transferd.log | grep -c "failing over: peer silent for 2s")
  all=$(cat $d/*/transferd.log | grep -c "failing over")
  c=$(python3 -c "import json;print(round(json.load(open('/work/s18/ab-$b-$loss-$i.json'))['results'][0]['completion_s'],2))" 2>/dev/null)
  echo "$b $i rc=$rc t=$c silent2s=$setup failovers=$all"
  echo "  setup_ms $(python3 /work/s18/setup_times.py $d)"; rm -rf $d
done; done
