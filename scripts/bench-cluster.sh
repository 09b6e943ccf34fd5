#!/usr/bin/env bash
# Cross-edge benchmark: keel-bench pairs with publisher and subscriber on the
# same edge, then on two different edges of a local cluster (coordinator,
# router, persistence, output, two edges; scripts/run-cluster.sh), QoS 0 and
# QoS 1, alternating REPEAT times. Prints medians and the cross/same ratio
# (bench-report; "broker" is same-edge or cross-edge).
#
# Three loads: INFLIGHT=1000 messages in flight across the publishers
# measures throughput; LAT_INFLIGHT=50 (one per publisher) is the latency
# of a closed loop that still keeps the machine's CPUs busy; LAT_RATE=1000
# messages a second, paced (open loop), is the latency a message sees on a
# path with room to spare, so that the p99 difference between same-edge
# and cross-edge is what forwarding adds, not a queue. (At 5000 a second
# the two edges of a cross-edge run already take 1.3 of this machine's 2
# CPUs: each message crosses the hop alone, unbatched.)
#
# PIN=1 gives each edge a CPU of its own, as pods with one CPU each would
# have: edge-0 (the publishers') runs on CPU 0, edge-1 and the load
# generator on CPU 1, in both cases. Unpinned, the two edges share both
# CPUs with each other and the generator, so across edges the same CPUs
# run two edges' work; pinned, each edge's work is bound by its own CPU.
#
# Environment: DURATION=5s WARMUP=1s REPEAT=3 CLIENTS=50 QOS="0 1"
#              INFLIGHT=1000 LAT_INFLIGHT=50 LAT_RATE=1000 PORT_OFFSET=20000 PIN=
#              OUT=.tmp/bench/cluster-<ts>
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GO=${GO:-go}
BIN=${BIN:-$ROOT/bin}

if [[ ${1:-} != --inside ]]; then
  OUT=${OUT:-$ROOT/.tmp/bench/cluster-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$OUT"
  echo "bench-cluster: building the services, keel-bench and bench-report"
  for svc in coordinator router persistence output edge; do
    "$GO" build -o "$BIN/keel-$svc" "./services/$svc/cmd/keel-$svc"
  done
  "$GO" build -o "$BIN/keel-bench" ./test/bench/cmd/keel-bench
  "$GO" build -o "$BIN/bench-report" ./test/bench/cmd/bench-report
  export OUT BIN
  if [[ -n ${PIN:-} ]]; then
    export EDGE_CPUS="0 1"
  fi
  EDGES=2 PORT_OFFSET=${PORT_OFFSET:-20000} LOG_LEVEL=warn DATA=$OUT/cluster \
    exec "$ROOT/scripts/run-cluster.sh" -- "$0" --inside
fi

# Inside the running cluster.
read -r A B _ <<<"$MQTT_ADDRS"
# Both edges are sampled in every run, the publishers' edge first: the
# report's broker CPU is theirs together, and each run's line gives each
# edge's CPU per message. On one machine the two edges share its cores, so
# cross-edge throughput is bound by the CPU of both; the busier edge's CPU
# per message is what bounds a cluster whose edges have cores of their own.
EDGE_A=$(awk '$1 == "edge-0" {print $2}' "$DATA/pids")
EDGE_B=$(awk '$1 == "edge-1" {print $2}' "$DATA/pids")
DURATION=${DURATION:-5s} WARMUP=${WARMUP:-1s} REPEAT=${REPEAT:-3}
CLIENTS=${CLIENTS:-50} INFLIGHT=${INFLIGHT:-1000}
gen=("$BIN/keel-bench")
[[ -n ${PIN:-} ]] && gen=(taskset -c 1 "$BIN/keel-bench")
results=$OUT/results.jsonl
: >"$results"
# The first runs on a fresh cluster come out at a third to a half of the
# rest (heaps, buffers and route caches still growing): one unrecorded run
# on each path first.
for sub in "$A" "$B"; do
  "${gen[@]}" -scenario pairs -clients "$CLIENTS" -qos 1 -size 64 -duration 3s -warmup 1s \
    -inflight "$INFLIGHT" -pub-addr "$A" -sub-addr "$sub" -broker warm-up -label warm-up >/dev/null 2>&1 || true
done
for load in "window $INFLIGHT" "window ${LAT_INFLIGHT:-50}" "rate ${LAT_RATE:-1000}"; do
  read -r kind n <<<"$load"
  label=pairs-$CLIENTS window=$INFLIGHT rate=0
  case $kind in
  window) window=$n; [[ $n != "$INFLIGHT" ]] && label=pairs-$CLIENTS-inflight-$n ;;
  rate) rate=$n label=pairs-$CLIENTS-paced-$n ;;
  esac
  for qos in ${QOS:-0 1}; do
    for rep in $(seq 1 "$REPEAT"); do
      for where in same-edge cross-edge; do
        sub=$A
        [[ $where == cross-edge ]] && sub=$B
        "${gen[@]}" -scenario pairs -clients "$CLIENTS" -qos "$qos" -size 64 \
          -duration "$DURATION" -warmup "$WARMUP" -inflight "$window" -rate "$rate" \
          -pub-addr "$A" -sub-addr "$sub" -broker "$where" -label "qos$qos-$label" \
          -broker-pid "$EDGE_A" -broker-pids "$EDGE_B" -json >>"$results"
        echo "bench-cluster: qos $qos $label $where run $rep: $(tail -1 "$results" | grep -o '"rate":[0-9.]*\|"p99_us":[0-9.]*\|"broker_cpu_us_per_op_by_process":\[[0-9.,]*\]' | tr '\n' ' ')"
      done
    done
  done
done
"$BIN/bench-report" -ratios cross-edge/same-edge "$results" | tee "$OUT/summary.md"
