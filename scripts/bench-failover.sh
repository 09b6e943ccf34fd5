#!/usr/bin/env bash
# Failover benchmark (issue 6): CLIENTS persistent-session QoS 1 subscribers
# spread over 3 edges (Redis primary + REDIS_REPLICAS replicas behind the
# persistence service, WAIT 1). A publisher on the first edge sends each of
# them one message; KILL_AFTER after the last PUBACK, keel-bench sends
# SIGKILL to the last edge and publishes a second round. The killed edge's
# clients reconnect to the other edges (refused with "server unavailable"
# until its lease expires) and the run reports, from the kill, how long until
# every client was back and every acknowledged message delivered, with loss,
# duplicates and refusals by reason.
#
# The coordinator's membership lease TTL sets most of the gap: run-cluster.sh
# does not pass --lease-ttl, so it is the coordinator's default (10s) unless
# LEASE_TTL is set here (it is exported as KEEL_LEASE_TTL, which only the
# coordinator reads). The edges' --cluster.forward-timeout (default 30s)
# bounds how long a publish to a dead edge's subscriber waits before the
# edge closes the publisher; EDGE_ARGS passes edge flags through.
#
# Environment: CLIENTS=10000 KILL_AFTER=1s ACK_TIMEOUT=40s RECOVER_TIMEOUT=2m
#              DRAIN=10s CONNECT_CONCURRENCY=100 INFLIGHT=1000 LEASE_TTL=
#              REDIS_REPLICAS=2 PORT_OFFSET=21000 LOG_LEVEL=warn
#              OUT=.tmp/bench/failover-<ts>
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GO=${GO:-go}
BIN=${BIN:-$ROOT/bin}

if [[ ${1:-} != --inside ]]; then
  command -v redis-server >/dev/null || { echo "bench-failover: redis-server not installed (make deps)" >&2; exit 1; }
  OUT=${OUT:-$ROOT/.tmp/bench/failover-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$OUT"
  echo "bench-failover: building the services and keel-bench"
  for svc in coordinator router persistence output edge; do
    "$GO" build -o "$BIN/keel-$svc" "./services/$svc/cmd/keel-$svc"
  done
  "$GO" build -o "$BIN/keel-bench" ./test/bench/cmd/keel-bench
  export OUT BIN
  if [[ -n ${LEASE_TTL:-} ]]; then export KEEL_LEASE_TTL=$LEASE_TTL; fi
  EDGES=3 REDIS_REPLICAS=${REDIS_REPLICAS:-2} PORT_OFFSET=${PORT_OFFSET:-21000} LOG_LEVEL=${LOG_LEVEL:-warn} DATA=$OUT/cluster \
    exec "$ROOT/scripts/run-cluster.sh" -- "$0" --inside
fi

# Inside the running cluster.
read -r -a addrs <<<"$MQTT_ADDRS"
last=$((${#addrs[@]} - 1))
killed=${addrs[$last]}
pid=$(awk -v n="edge-$last" '$1 == n { print $2 }' "$OUT/cluster/pids")
[[ -n $pid ]] || { echo "bench-failover: no pid for edge-$last in $OUT/cluster/pids" >&2; exit 1; }
ttl=${LEASE_TTL:-10s (coordinator default)}
echo "bench-failover: ${CLIENTS:-10000} clients on ${MQTT_ADDRS// /, }; killing edge-$last ($killed, pid $pid); lease TTL $ttl"
rc=0
"$BIN/keel-bench" -scenario failover -clients "${CLIENTS:-10000}" -size 64 \
  -addrs "$(IFS=,; echo "${addrs[*]}")" -kill-pid "$pid" -killed-addr "$killed" \
  -kill-after "${KILL_AFTER:-1s}" -ack-timeout "${ACK_TIMEOUT:-40s}" -recover-timeout "${RECOVER_TIMEOUT:-2m}" \
  -drain "${DRAIN:-10s}" -connect-concurrency "${CONNECT_CONCURRENCY:-100}" -inflight "${INFLIGHT:-1000}" \
  -broker keel-3-edges -label "failover-edge-kill" -json -text-out "$OUT/result.txt" \
  >"$OUT/result.json" 2>"$OUT/keel-bench.log" || rc=$?
{
  echo "Edge kill with persistent QoS 1 sessions, 3 edges, Redis + ${REDIS_REPLICAS:-2} replicas (WAIT 1), lease TTL $ttl:"
  if [[ -s $OUT/result.txt ]]; then cat "$OUT/result.txt"; else echo "  no result (keel-bench exit $rc):"; sed 's/^/  /' "$OUT/keel-bench.log"; fi
  echo "  JSON: $OUT/result.json; cluster logs: $OUT/cluster"
} | tee "$OUT/summary.txt"
exit "$rc"
