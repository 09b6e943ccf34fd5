#!/usr/bin/env bash
# Runs a local Keel cluster as processes on this machine: one coordinator,
# one router, one persistence instance (embedded store), one output service
# (empty rules) and EDGES edges (MQTT on 1883, 1884, ..., WebSocket on 8083,
# 8084, ..., ops on 9100, 9101, ...). Ctrl-C stops them all; each edge hands
# its persistent sessions to another one as it stops. State lives under
# data/cluster. `make run` is this with one edge.
#
#   scripts/run-cluster.sh [-- command args...]
#
# With a command, it runs the command once the cluster is ready, stops the
# cluster and exits with the command's status (used by the cluster
# benchmarks). PORT_OFFSET moves every port, so a benchmark cluster can run
# beside `make run`; the command sees MQTT_ADDRS (the edges' MQTT addresses,
# space-separated) and OPS_ADDRS (their ops addresses). EDGE_ARGS adds flags
# to every edge (for example --ops.pprof), PERSISTENCE_ARGS to the
# persistence instance. EDGE_CPUS (space-separated, one per edge) runs each
# edge on the CPU given (taskset), as a pod with a CPU of its own would run:
# the Go runtime then uses that one CPU. REDIS_REPLICAS=N runs the
# persistence instance in front of a local redis-server primary (port
# 6379+PORT_OFFSET) and N replicas, every acknowledged write on one of them
# (WAIT 1), instead of its embedded store.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$ROOT/bin}
EDGES=${EDGES:-3}
DATA=${DATA:-$ROOT/data/cluster}
LOG_LEVEL=${LOG_LEVEL:-info}
O=${PORT_OFFSET:-0}
cmd=()
if [[ ${1:-} == -- ]]; then
  shift
  cmd=("$@")
fi
mkdir -p "$DATA"
: >"$DATA/pids" # "name pid" per process, for the benchmarks
pids=()
stop() {
  trap - INT TERM EXIT
  echo "stopping the cluster"
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop INT TERM EXIT
start() { # name, command...
  local name=$1; shift
  "$@" >"$DATA/$name.log" 2>&1 &
  pids+=($!)
  echo "$name $!" >>"$DATA/pids"
  echo "started $name (pid $!, log $DATA/$name.log)"
}
ready() { # name, ops address
  for _ in $(seq 1 150); do
    curl -fsS "http://$2/readyz" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "$1 did not become ready; see $DATA/$1.log" >&2
  exit 1
}

start coordinator "$BIN/keel-coordinator" --api.addr 127.0.0.1:$((7401 + O)) --ops.addr 127.0.0.1:$((9201 + O)) \
  --raft.bind-addr 127.0.0.1:$((7400 + O)) --gossip.bind-addr 127.0.0.1:$((7946 + O)) --raft.bootstrap-expect 1 \
  --raft.node-id coordinator-1 --raft.data-dir "$DATA/coordinator" --router.url http://127.0.0.1:$((9300 + O)) \
  --log.format text --log.level "$LOG_LEVEL"
ready coordinator 127.0.0.1:$((9201 + O))
start router "$BIN/keel-router" --api.addr 127.0.0.1:$((9300 + O)) --ops.addr 127.0.0.1:$((9202 + O)) --olric.single-node \
  --olric.bind-addr 127.0.0.1 --olric.port $((3320 + O)) --olric.memberlist-port $((3322 + O)) --log.format text --log.level "$LOG_LEVEL"
ready router 127.0.0.1:$((9202 + O))
store=(--data-dir "$DATA/persistence")
if ((${REDIS_REPLICAS:-0} > 0)); then
  replicas=""
  for i in $(seq 0 "$REDIS_REPLICAS"); do
    port=$((6379 + i + O))
    mkdir -p "$DATA/redis-$i"
    # No 5 s wait for more replicas before the first sync: writes wait for
    # a replica (WAIT 1), so they fail until one is in sync.
    args=(--port "$port" --bind 127.0.0.1 --save "" --appendonly yes --dir "$DATA/redis-$i" --repl-diskless-sync-delay 0)
    ((i > 0)) && args+=(--replicaof 127.0.0.1 $((6379 + O))) && replicas+="${replicas:+,}127.0.0.1:$port"
    start "redis-$i" redis-server "${args[@]}"
  done
  for i in $(seq 0 "$REDIS_REPLICAS"); do
    until redis-cli -p $((6379 + i + O)) ping >/dev/null 2>&1; do sleep 0.1; done
  done
  until (($(redis-cli -p $((6379 + O)) info replication | grep -c 'state=online') >= REDIS_REPLICAS)); do sleep 0.1; done
  store=(--redis.addr 127.0.0.1:$((6379 + O)) --redis.replicas "$replicas" --redis.min-replicas 1)
fi
start persistence "$BIN/keel-persistence" --api.addr 127.0.0.1:$((7402 + O)) --ops.addr 127.0.0.1:$((9203 + O)) \
  "${store[@]}" --coordinator.addr http://127.0.0.1:$((7401 + O)) --log.format text --log.level "$LOG_LEVEL" ${PERSISTENCE_ARGS:-}
ready persistence 127.0.0.1:$((9203 + O))
printf 'tenants: {}\n' >"$DATA/output-rules.yaml"
start output "$BIN/keel-output" --listen-addr 127.0.0.1:$((9310 + O)) --ops.addr 127.0.0.1:$((9204 + O)) \
  --rules.file "$DATA/output-rules.yaml" --log.format text --log.level "$LOG_LEVEL"
ready output 127.0.0.1:$((9204 + O))
MQTT_ADDRS="" OPS_ADDRS=""
read -r -a edge_cpus <<<"${EDGE_CPUS:-}"
for i in $(seq 0 $((EDGES - 1))); do
  port=$((1883 + i + O)) ops=127.0.0.1:$((9100 + i + O))
  pin=()
  [[ -n ${edge_cpus[i]:-} ]] && pin=(taskset -c "${edge_cpus[i]}")
  start "edge-$i" "${pin[@]}" "$BIN/keel-edge" --auth.anonymous --mqtt.edge-id "edge-$i" \
    --mqtt.tcp-addr ":$port" --mqtt.ws-addr ":$((8083 + i + O))" --ops.addr "$ops" \
    --data-dir "$DATA/edge-$i" --cluster.coordinator http://127.0.0.1:$((7401 + O)) \
    --cluster.router http://127.0.0.1:$((9300 + O)) --cluster.api-addr "127.0.0.1:$((7411 + i + O))" \
    --cluster.persistence http://127.0.0.1:$((7402 + O)) \
    --output.url http://127.0.0.1:$((9310 + O)) --log.format text --log.level "$LOG_LEVEL" ${EDGE_ARGS:-}
  ready "edge-$i" "$ops"
  MQTT_ADDRS+="${MQTT_ADDRS:+ }127.0.0.1:$port" OPS_ADDRS+="${OPS_ADDRS:+ }$ops"
done
export MQTT_ADDRS OPS_ADDRS
# A router that starts with an empty table answers no route lookup until the
# edges had time to register their routes again (router.rebuild-wait, 5 s):
# what is published meanwhile waits. Wait for the first message routed
# through edge-0, so that benchmarks do not measure that wait.
routed() {
  if ! command -v mosquitto_sub >/dev/null; then
    sleep 6
    return 0
  fi
  local port=$((1883 + O)) topic="keel/run-cluster/$$"
  mosquitto_sub -h 127.0.0.1 -p "$port" -t "$topic" -C 1 -W 30 >/dev/null &
  local sub=$!
  sleep 0.2
  while kill -0 "$sub" 2>/dev/null; do
    timeout 5 mosquitto_pub -h 127.0.0.1 -p "$port" -t "$topic" -q 1 -m ready >/dev/null 2>&1 || true
    sleep 0.2
  done
  wait "$sub" || { echo "no message routed within 30 s; see $DATA/router.log" >&2; exit 1; }
}
routed
if ((${#cmd[@]})); then
  "${cmd[@]}"
  exit $?
fi
echo "Keel is up: MQTT on $MQTT_ADDRS — Ctrl-C stops everything"
wait -n || true
