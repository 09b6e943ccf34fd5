# Build, run and test.

GOFLAGS_TEST ?= -race -count=1
TEST_TIMEOUT ?= 20m
APT_PACKAGES := redis-server mosquitto mosquitto-clients postgresql kcat

.PHONY: build
build: ## Build every binary into bin/
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./services/edge/cmd/keel-edge ./services/edge/cmd/keelctl ./services/router/cmd/keel-router ./services/coordinator/cmd/keel-coordinator ./services/persistence/cmd/keel-persistence
	$(GO) build -o $(BIN)/ ./services/output/cmd/...

.PHONY: run run-edge
run: build ## Run a local Keel cluster on embedded defaults (MQTT on :1883, WebSocket on :8083; EDGES=3 for :1883-:1885)
	EDGES=$${EDGES:-1} BIN=$(BIN) scripts/run-cluster.sh

run-edge: build ## Run one edge alone, with no cluster (MQTT on :1883, WebSocket on :8083, ops on :9100)
	$(BIN)/keel-edge --auth.anonymous=true --data-dir $(ROOT)/data/edge --log.format text

.PHONY: deps
deps: ## Install what the tests need (Debian packages) when missing
	@missing=""; \
	for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@command -v python3 >/dev/null || { echo "installing: python3"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends python3 >/dev/null; }

.PHONY: vet
vet: ## go vet the whole workspace
	$(GO) vet work

.PHONY: test
test: deps vet ## Install test dependencies, then run every test with the race detector, and Mosquitto's broker tests
	GO=$(GO) scripts/test.sh $(GOFLAGS_TEST) -timeout $(TEST_TIMEOUT) work
	GO=$(GO) test/conformance/mosquitto/run.sh

.PHONY: conformance-mosquitto
conformance-mosquitto: ## Run Mosquitto's broker tests (its Debian source) against keel-edge; ALL=1 also runs those not listed to pass
	GO=$(GO) test/conformance/mosquitto/run.sh

.PHONY: test-short
test-short: ## Unit tests only (-short), with the race detector
	$(GO) test $(GOFLAGS_TEST) -short work

.PHONY: fuzz
fuzz: ## Run every fuzz target for FUZZTIME each (default 30s)
	@scripts/fuzz.sh $${FUZZTIME:-30s}

.PHONY: lint
lint: vet proto-lint ## Static checks: go vet, gofmt, buf lint
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '^proto/gen/')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

.PHONY: clean
clean: ## Remove build output
	rm -rf $(BIN)

.PHONY: images
images: ## Build the container images locally (FROM scratch, no registry): keel/<service>:dev and keel/redis:dev
	scripts/images.sh $${TAG:-dev}

.PHONY: e2e
e2e: ## Run the container end-to-end suite (needs a Docker engine; builds images locally)
	@docker ps -aq --filter label=org.testcontainers=true | xargs -r docker rm -f >/dev/null
	KEEL_E2E=1 E2E_REQUIRE_DOCKER=1 TESTCONTAINERS_RYUK_DISABLED=true TESTCONTAINERS_HOST_OVERRIDE=localhost \
		GO=$(GO) scripts/test.sh -count=1 -timeout 20m ./test/e2e/...
	@docker ps -aq --filter label=org.testcontainers=true | xargs -r docker rm -f >/dev/null
	@docker network prune -f --filter label=org.testcontainers=true >/dev/null

.PHONY: run-cluster
run-cluster: build ## Run a local cluster as processes: coordinator, router, persistence, output and EDGES edges (MQTT on :1883..)
	EDGES=$${EDGES:-3} BIN=$(BIN) scripts/run-cluster.sh
