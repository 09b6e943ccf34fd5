#!/usr/bin/env bash
# Runs a local Keel cluster as processes on this machine: one coordinator,
# one router, one persistence instance (embedded store), one output service
# (empty rules) and EDGES edges (MQTT on 1883, 1884, ...). Ctrl-C stops them
# all. State lives under data/cluster.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN:-$ROOT/bin}
EDGES=${EDGES:-3}
DATA=${DATA:-$ROOT/data/cluster}
mkdir -p "$DATA"
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

start coordinator "$BIN/keel-coordinator" --api.addr 127.0.0.1:7401 --ops.addr 127.0.0.1:9201 \
  --raft.bind-addr 127.0.0.1:7400 --gossip.bind-addr 127.0.0.1:7946 --raft.bootstrap-expect 1 \
  --raft.node-id coordinator-1 --raft.data-dir "$DATA/coordinator" --log.format text
ready coordinator 127.0.0.1:9201
start router "$BIN/keel-router" --api.addr 127.0.0.1:9300 --ops.addr 127.0.0.1:9202 --olric.single-node \
  --olric.bind-addr 127.0.0.1 --olric.port 3320 --olric.memberlist-port 3322 --log.format text
ready router 127.0.0.1:9202
start persistence "$BIN/keel-persistence" --api.addr 127.0.0.1:7402 --ops.addr 127.0.0.1:9203 \
  --data-dir "$DATA/persistence" --coordinator.addr http://127.0.0.1:7401 --log.format text
ready persistence 127.0.0.1:9203
printf 'tenants: {}\n' >"$DATA/output-rules.yaml"
start output "$BIN/keel-output" --listen-addr 127.0.0.1:9310 --ops.addr 127.0.0.1:9204 \
  --rules.file "$DATA/output-rules.yaml" --log.format text
ready output 127.0.0.1:9204
for i in $(seq 0 $((EDGES - 1))); do
  start "edge-$i" "$BIN/keel-edge" --auth.anonymous --mqtt.edge-id "edge-$i" \
    --mqtt.tcp-addr ":$((1883 + i))" --mqtt.ws-addr "" --ops.addr "127.0.0.1:$((9100 + i))" \
    --data-dir "$DATA/edge-$i" --cluster.coordinator http://127.0.0.1:7401 --cluster.router http://127.0.0.1:9300 \
    --cluster.api-addr "127.0.0.1:$((7411 + i))" --output.url http://127.0.0.1:9310 --log.format text
  ready "edge-$i" "127.0.0.1:$((9100 + i))"
done
echo "Keel is up: MQTT on $(seq -s ' ' 1883 $((1883 + EDGES - 1))) — Ctrl-C stops everything"
wait -n || true
