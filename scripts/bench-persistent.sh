#!/usr/bin/env bash
# Persistent-session benchmark: QoS 1 pairs across two edges whose
# subscribers keep persistent sessions, so every message is stored in the
# persistence service before it is acknowledged. The persistence instance
# fronts a local Redis primary with REDIS_REPLICAS replicas (default 2) and
# every write waits for one of them (WAIT 1). Prints the delivered rate and
# the CPU time each process spent per delivered message (whole run,
# connects included).
#
# The window is 4000 messages in flight across the publishers (80 each): a
# delivery to a persistent session waits for a Redis commit and WAIT, so a
# smaller window measures that latency more than the throughput (INFLIGHT=1000
# gives about a fifth less).
#
# Environment: DURATION=10s WARMUP=2s CLIENTS=50 INFLIGHT=4000
#              REDIS_REPLICAS=2 PORT_OFFSET=20000 OUT=.tmp/bench/persistent-<ts>
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GO=${GO:-go}
BIN=${BIN:-$ROOT/bin}

if [[ ${1:-} != --inside ]]; then
  command -v redis-server >/dev/null || { echo "bench-persistent: redis-server not installed (make deps)" >&2; exit 1; }
  OUT=${OUT:-$ROOT/.tmp/bench/persistent-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$OUT"
  echo "bench-persistent: building the services and keel-bench"
  for svc in coordinator router persistence output edge; do
    "$GO" build -o "$BIN/keel-$svc" "./services/$svc/cmd/keel-$svc"
  done
  "$GO" build -o "$BIN/keel-bench" ./test/bench/cmd/keel-bench
  export OUT BIN
  EDGES=2 REDIS_REPLICAS=${REDIS_REPLICAS:-2} PORT_OFFSET=${PORT_OFFSET:-20000} LOG_LEVEL=warn DATA=$OUT/cluster \
    exec "$ROOT/scripts/run-cluster.sh" -- "$0" --inside
fi

# Inside the running cluster.
read -r A B _ <<<"$MQTT_ADDRS"
ticks() { # pid -> utime+stime in clock ticks
  awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0
}
declare -A before
while read -r name pid; do before[$name]=$(ticks "$pid"); done <"$OUT/cluster/pids"
TIMEFORMAT='%U %S'
{ time "$BIN/keel-bench" -scenario pairs -clients "${CLIENTS:-50}" -qos 1 -size 64 -persistent \
  -duration "${DURATION:-10s}" -warmup "${WARMUP:-2s}" -inflight "${INFLIGHT:-4000}" \
  -pub-addr "$A" -sub-addr "$B" -broker cross-edge-persistent -label "qos1-persistent-pairs" -json \
  >"$OUT/result.json" 2>"$OUT/keel-bench.log"; } 2>"$OUT/keel-bench.time"
hz=$(getconf CLK_TCK)
delivered=$(grep -o '"delivered":[0-9]*' "$OUT/result.json" | cut -d: -f2)
rate=$(grep -o '"rate":[0-9.]*' "$OUT/result.json" | cut -d: -f2)
{
  echo "QoS 1 cross-edge pairs, persistent subscribers, Redis + ${REDIS_REPLICAS:-2} replicas (WAIT 1):"
  echo "  delivered $rate msgs/s in the measured window; $delivered delivered over the whole run"
  echo "  lost/dup/ooo: $(grep -o '"lost":[0-9]*\|"dup":[0-9]*\|"ooo":[0-9]*' "$OUT/result.json" | cut -d: -f2 | tr '\n' ' ')"
  echo "  CPU µs per delivered message:"
  total=0
  while read -r name pid; do
    d=$(( $(ticks "$pid") - ${before[$name]} ))
    us=$(awk -v d="$d" -v hz="$hz" -v n="$delivered" 'BEGIN { printf "%.1f", (n > 0 ? d / hz * 1e6 / n : 0) }')
    total=$(awk -v a="$total" -v b="$us" 'BEGIN { print a + b }')
    printf '    %-12s %8s\n' "$name" "$us"
  done <"$OUT/cluster/pids"
  read -r u s <"$OUT/keel-bench.time"
  lg=$(awk -v u="$u" -v s="$s" -v n="$delivered" 'BEGIN { printf "%.1f", (n > 0 ? (u + s) * 1e6 / n : 0) }')
  printf '    %-12s %8s\n' keel-bench "$lg"
  printf '    %-12s %8s\n' total "$(awk -v a="$total" -v b="$lg" 'BEGIN { print a + b }')"
} | tee "$OUT/summary.txt"
