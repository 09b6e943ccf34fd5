# Benchmarks: Go micro-benchmarks across the workspace, and the keel-bench load
# generator against Mosquitto, bare mochi and the Keel edge (scripts/bench.sh).
#
#   make bench                       all three (about 12 minutes on 2 cores)
#   make bench-cluster REPEAT=3      same-edge vs cross-edge pairs on a local cluster
#   make bench-persistent            QoS 1 across edges to persistent sessions in Redis (WAIT 1)
#   make bench-failover CLIENTS=1000 kill one of 3 edges under persistent QoS 1 subscribers
#   make bench-output                MQTT → output service → Kafka beside kafka-go direct (ratios)
#   make bench BENCH_GO=0            load benchmarks only
#   make bench-load DURATION=10s REPEAT=5 SCENARIOS=qos0-fanin-64B,qos1-pairs-50
#   make bench-go BENCH_PKGS=./libs/...   then compare runs with benchstat
#
# Load-benchmark knobs (DURATION, WARMUP, REPEAT, BROKERS, SCENARIOS, INFLIGHT,
# STORM_CLIENTS, IDLE_CLIENTS, WAIT_QUIET, OUT) are read by scripts/bench.sh from
# the environment; see its header.

BENCH_GO    ?= 1
BENCH_TIME  ?= 500ms
BENCH_COUNT ?= 1
BENCH_PKGS  ?= work
BENCH_OUT   ?= $(TMP)/bench
BENCH_OUTPUT_COUNT ?= 3

.PHONY: bench bench-go bench-load bench-cluster bench-persistent bench-output bench-failover

bench: ## Run benchmarks: Go benchmarks + load generator vs Mosquitto and bare mochi
	@rc=0; \
	if [ "$(BENCH_GO)" != 0 ]; then $(MAKE) bench-go || rc=$$?; fi; \
	$(MAKE) bench-load || rc=$$?; \
	$(MAKE) bench-cluster || rc=$$?; \
	$(MAKE) bench-persistent || rc=$$?; \
	$(MAKE) bench-output || rc=$$?; \
	exit $$rc

bench-go: ## Run Go benchmarks with -benchmem over the workspace modules (BENCH_PKGS, BENCH_TIME)
	@mkdir -p $(BENCH_OUT)
	$(GO) test -run '^$$' -bench . -benchmem -benchtime=$(BENCH_TIME) -count=$(BENCH_COUNT) $(BENCH_PKGS) \
		| tee $(BENCH_OUT)/go-$$(date +%Y%m%d-%H%M%S).txt

bench-load: deps ## Run keel-bench scenarios against Mosquitto, bare mochi and the Keel edge (installs Mosquitto when missing)
	GO=$(GO) BIN=$(BIN) scripts/bench.sh

bench-cluster: ## Run keel-bench pairs on one edge and across two edges of a local cluster
	GO=$(GO) BIN=$(BIN) scripts/bench-cluster.sh

bench-persistent: ## Run QoS 1 pairs across edges to persistent sessions (Redis primary + 2 replicas, WAIT 1), CPU per message by process
	GO=$(GO) BIN=$(BIN) scripts/bench-persistent.sh

bench-output: ## MQTT and edge-client streams through one output instance to Kafka (kfake) beside kafka-go writing directly: msgs/s, ratios, p99
	@mkdir -p $(BENCH_OUT)
	cd services/output && $(GO) test -run '^$$' -bench BenchmarkOutput_Kafka -benchtime 200000x -count $(BENCH_OUTPUT_COUNT) ./internal/app \
		| tee $(BENCH_OUT)/output-$$(date +%Y%m%d-%H%M%S).txt

bench-failover: ## Kill one of 3 edges under CLIENTS persistent QoS 1 subscribers: time until all are back and every acked message delivered
	GO=$(GO) BIN=$(BIN) scripts/bench-failover.sh
