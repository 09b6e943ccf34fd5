#!/usr/bin/env bash
# Load benchmarks: keel-bench against Mosquitto, bare mochi and the Keel edge.
#
# Each scenario runs REPEAT times against each broker in turn (mosquitto,
# mochi, keel, mosquitto, …), each run on a freshly started broker on a port
# of its own on 127.0.0.1. keel-bench samples the broker's CPU (utime+stime
# from /proc/<pid>/stat) and RSS over the measured window itself, so setup and
# drain are not counted. Results go to $OUT/results.jsonl; the summary (medians,
# ratios) to $OUT/summary.md and stdout. A broker whose binary is missing or
# fails to build is skipped with a message.
#
# Environment:
#   DURATION=3s WARMUP=1s REPEAT=3   measured time, unmeasured warmup, repeats
#   BROKERS="mosquitto mochi keel"   brokers, in the order they alternate
#   SCENARIOS=all                     or a comma list of labels (see SPECS below)
#   INFLIGHT=1000                     closed-loop window across all publishers
#                                     (the paced scenario sends 5000 msgs/s: the
#                                     same rate for all, so compare CPU/msg)
#   STORM_CLIENTS=5000 IDLE_CLIENTS=10000 IDLE_REPEAT=1
#   WAIT_QUIET=3s                     before each run, wait up to this long for
#                                     the machine to be idle (0 = don't)
#   MAX_OTHER=0.3 RETRIES=1          run again (up to RETRIES times) when other
#                                     processes used more than MAX_OTHER cores
#   OUT=.tmp/bench/<timestamp>  GO=go  BIN=bin
#
# Keep the default run under ~10 minutes on 2 cores: 8 message scenarios ×
# 3 brokers × 3 repeats × ~6 s, plus storms and one idle-memory run each.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GO=${GO:-go}
BIN=${BIN:-$ROOT/bin}
DURATION=${DURATION:-3s}
WARMUP=${WARMUP:-1s}
REPEAT=${REPEAT:-3}
BROKERS=${BROKERS:-mosquitto mochi keel}
SCENARIOS=${SCENARIOS:-all}
INFLIGHT=${INFLIGHT:-1000}
STORM_CLIENTS=${STORM_CLIENTS:-5000}
IDLE_CLIENTS=${IDLE_CLIENTS:-10000}
IDLE_REPEAT=${IDLE_REPEAT:-1}
WAIT_QUIET=${WAIT_QUIET:-3s}
MAX_OTHER=${MAX_OTHER:-0.3}
RETRIES=${RETRIES:-1}
OUT=${OUT:-$ROOT/.tmp/bench/$(date +%Y%m%d-%H%M%S)}

# label | keel-bench arguments
SPECS=(
	"qos0-fanin-64B|-scenario fanin -qos 0 -size 64 -clients 50"
	"qos0-fanin-1KiB|-scenario fanin -qos 0 -size 1024 -clients 50"
	"qos0-fanout-1to50|-scenario fanout -qos 0 -size 64 -clients 50"
	"qos0-pairs-50|-scenario pairs -qos 0 -size 64 -clients 50"
	"qos1-pairs-50|-scenario pairs -qos 1 -size 64 -clients 50"
	"qos1-fanin-50|-scenario fanin -qos 1 -size 64 -clients 50"
	"qos2-pairs-50|-scenario pairs -qos 2 -size 64 -clients 50"
	"qos0-pairs-50-paced-5000|-scenario pairs -qos 0 -size 64 -clients 50 -rate 5000"
	"storm-${STORM_CLIENTS}|-scenario storm -clients ${STORM_CLIENTS}"
	"idle-${IDLE_CLIENTS}|-scenario idle -clients ${IDLE_CLIENTS} -hold 3s"
	"idle-${IDLE_CLIENTS}-pinged|-scenario idle -clients ${IDLE_CLIENTS} -hold 3s -ping"
)

log() { printf '%s\n' "$*" >&2; }
die() { log "bench: $*"; exit 1; }

mkdir -p "$OUT" "$BIN"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/keel-bench.XXXXXX")
chmod 755 "$WORK" # mosquitto drops root to user mosquitto

BROKER_PID=""
cleanup() {
	stop_broker
	rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 10,000 idle clients need as many descriptors in keel-bench and the broker
# (which inherits this limit).
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if (($(ulimit -n) < IDLE_CLIENTS + 200)); then
	log "bench: open-file limit $(ulimit -n) is below IDLE_CLIENTS+200; lowering IDLE_CLIENTS"
	IDLE_CLIENTS=$(($(ulimit -n) - 200))
	SPECS[8]="idle-${IDLE_CLIENTS}|-scenario idle -clients ${IDLE_CLIENTS} -hold 3s"
	SPECS[9]="idle-${IDLE_CLIENTS}-pinged|-scenario idle -clients ${IDLE_CLIENTS} -hold 3s -ping"
fi

# --- build -------------------------------------------------------------------
cd "$ROOT"
log "bench: building keel-bench, bare-mochi, bench-report"
"$GO" build -o "$BIN/keel-bench" ./test/bench/cmd/keel-bench
# Outside the workspace: the edge's module replaces mochi with Keel's
# patched copy (third_party/mochi), and the reference is mochi as released.
(cd test/bench && GOWORK=off "$GO" build -o "$BIN/bare-mochi" ./cmd/bare-mochi)
"$GO" build -o "$BIN/bench-report" ./test/bench/cmd/bench-report

available=()
for b in $BROKERS; do
	case $b in
	mosquitto)
		if command -v mosquitto >/dev/null; then
			available+=(mosquitto)
		else
			log "bench: SKIP mosquitto: not installed (apt-get install -y mosquitto)"
		fi
		;;
	mochi) available+=(mochi) ;;
	keel)
		if "$GO" build -o "$BIN/keel-edge" ./services/edge/cmd/keel-edge >"$OUT/build-keel-edge.log" 2>&1; then
			available+=(keel)
		else
			log "bench: SKIP keel: ./services/edge/cmd/keel-edge failed to build (see $OUT/build-keel-edge.log):"
			tail -n 5 "$OUT/build-keel-edge.log" | sed 's/^/    /' >&2
		fi
		;;
	*) die "unknown broker $b (want mosquitto, mochi or keel)" ;;
	esac
done
((${#available[@]} > 0)) || die "no broker to measure"

# --- brokers -----------------------------------------------------------------

# free_port prints a loopback TCP port nobody listens on, below the ephemeral
# range so that it cannot collide with keel-bench's own client ports.
free_port() {
	local p
	for _ in $(seq 200); do
		p=$((20000 + RANDOM % 12000))
		if ! command -v ss >/dev/null || [[ -z $(ss -Htln "sport = :$p" 2>/dev/null) ]]; then
			echo "$p"
			return
		fi
	done
	die "no free port"
}

wait_port() { # port pid logfile
	for _ in $(seq 200); do
		if ! kill -0 "$2" 2>/dev/null; then
			log "bench: broker exited at start:"
			tail -n 20 "$3" | sed 's/^/    /' >&2
			return 1
		fi
		if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
			return 0
		fi
		sleep 0.05
	done
	log "bench: broker did not listen on $1 within 10s"
	return 1
}

# start_broker NAME sets BROKER_PID and BROKER_ADDR.
start_broker() {
	local name=$1 port dir
	port=$(free_port)
	dir=$(mktemp -d "$WORK/$name.XXXXXX")
	chmod 777 "$dir"
	case $name in
	mosquitto)
		# shared/notes/peers.md: a plain process with its own config;
		# max_queued_messages 1000000 avoids 2.0.11's QoS 1 fan-in drops.
		cat >"$dir/mosquitto.conf" <<-EOF
			listener $port 127.0.0.1
			allow_anonymous true
			persistence false
			log_type error
			log_dest stderr
			connection_messages false
			max_queued_messages 1000000
		EOF
		mosquitto -c "$dir/mosquitto.conf" >"$dir/log" 2>&1 &
		;;
	mochi)
		"$BIN/bare-mochi" -addr "127.0.0.1:$port" >"$dir/log" 2>&1 &
		;;
	keel)
		"$BIN/keel-edge" --mqtt.tcp-addr "127.0.0.1:$port" --mqtt.ws-addr "" \
			--ops.addr "127.0.0.1:$(free_port)" --data-dir "$dir/data" \
			--auth.anonymous=true --log.level error >"$dir/log" 2>&1 &
		;;
	esac
	BROKER_PID=$!
	BROKER_ADDR=127.0.0.1:$port
	BROKER_LOG=$dir/log
	wait_port "$port" "$BROKER_PID" "$dir/log"
}

stop_broker() {
	[[ -n $BROKER_PID ]] || return 0
	kill -TERM "$BROKER_PID" 2>/dev/null || true
	for _ in $(seq 100); do
		kill -0 "$BROKER_PID" 2>/dev/null || break
		sleep 0.05
	done
	kill -KILL "$BROKER_PID" 2>/dev/null || true
	wait "$BROKER_PID" 2>/dev/null || true
	BROKER_PID=""
}

# --- runs --------------------------------------------------------------------
selected=()
for spec in "${SPECS[@]}"; do
	label=${spec%%|*}
	if [[ $SCENARIOS == all || ",$SCENARIOS," == *",$label,"* ]]; then
		selected+=("$spec")
	fi
done
((${#selected[@]} > 0)) || die "SCENARIOS=$SCENARIOS matches none of the labels"

RESULTS=$OUT/results.jsonl
: >"$RESULTS"
log "bench: brokers: ${available[*]}; duration $DURATION, warmup $WARMUP, repeat $REPEAT; output $OUT"
log "bench: load before start: $(cut -d' ' -f1-3 /proc/loadavg)"

total=0
for spec in "${selected[@]}"; do
	reps=$REPEAT
	[[ $spec == idle-* ]] && reps=$IDLE_REPEAT
	total=$((total + reps * ${#available[@]}))
done

# run_once BROKER LABEL ARGS: one run on a fresh broker; the result goes to
# $WORK/run.json, keel-bench's stderr to $WORK/run.err.
run_once() {
	local b=$1 label=$2 args=$3 rc=0
	: >"$WORK/run.json"
	if ! start_broker "$b"; then
		stop_broker
		echo "broker $b did not start" >"$WORK/run.err"
		return 1
	fi
	# shellcheck disable=SC2086 # args is a list of flags
	"$BIN/keel-bench" $args -addr "$BROKER_ADDR" -broker-pid "$BROKER_PID" \
		-broker "$b" -label "$label" -duration "$DURATION" -warmup "$WARMUP" \
		-inflight "$INFLIGHT" -wait-quiet "$WAIT_QUIET" -json \
		>"$WORK/run.json" 2>"$WORK/run.err" || rc=$?
	if ! kill -0 "$BROKER_PID" 2>/dev/null; then
		log "bench: $b died during $label; its log:"
		tail -n 20 "$BROKER_LOG" | sed 's/^/    /' >&2
		rc=1
	fi
	stop_broker
	return "$rc"
}

n=0
failures=0
for spec in "${selected[@]}"; do
	label=${spec%%|*}
	args=${spec#*|}
	reps=$REPEAT
	[[ $label == idle-* ]] && reps=$IDLE_REPEAT
	for ((r = 1; r <= reps; r++)); do
		for b in "${available[@]}"; do
			n=$((n + 1))
			for ((attempt = 0; attempt <= RETRIES; attempt++)); do
				rc=0
				run_once "$b" "$label" "$args" || rc=$?
				other=$(sed -nE 's/.*"other_cores":([0-9.e+-]+).*/\1/p' "$WORK/run.json" 2>/dev/null || true)
				if ((rc == 0)) && ((attempt < RETRIES)) && [[ -n $other ]] &&
					awk -v o="$other" -v m="$MAX_OTHER" 'BEGIN { exit !(o > m) }'; then
					log "[$n/$total] $label $b run $r: other processes used $other cores (> MAX_OTHER=$MAX_OTHER); running it again"
					continue
				fi
				break
			done
			if [[ -s $WORK/run.json ]]; then
				cat "$WORK/run.json" >>"$RESULTS"
			fi
			line=$(sed -nE 's/.*"rate":([0-9.e+]+).*"unit":"([^"]*)".*"other_cores":([0-9.e+-]+).*/\1 \2 (other processes \3 cores)/p' "$WORK/run.json" 2>/dev/null || true)
			if ((rc != 0)); then
				failures=$((failures + 1))
				log "[$n/$total] $label $b run $r: FAILED (exit $rc): $(tail -n 3 "$WORK/run.err" | tr '\n' ' ') $line"
			else
				log "[$n/$total] $label $b run $r: $line"
			fi
		done
	done
done

log "bench: load at end: $(cut -d' ' -f1-3 /proc/loadavg)"
ratios=""
for pair in keel/mosquitto keel/mochi mochi/mosquitto; do
	num=${pair%/*} den=${pair#*/}
	if [[ " ${available[*]} " == *" $num "* && " ${available[*]} " == *" $den "* ]]; then
		ratios+="${ratios:+,}$pair"
	fi
done
{
	echo "# keel-bench $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo
	echo "brokers: ${available[*]}; duration $DURATION, warmup $WARMUP, repeat $REPEAT (idle $IDLE_REPEAT), inflight $INFLIGHT; $(nproc) CPUs; mosquitto $(mosquitto -h 2>/dev/null | head -n1 | awk '{print $3}')"
	echo
	"$BIN/bench-report" -ratios "$ratios" "$RESULTS"
} | tee "$OUT/summary.md"
log "bench: results in $RESULTS, summary in $OUT/summary.md"
if ((failures > 0)); then
	die "$failures run(s) failed"
fi
