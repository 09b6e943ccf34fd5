// Package conformance drives a keel-edge binary as a black box with real MQTT
// clients and checks it against the MQTT 5.0 (and 3.1.1) specification.
//
// TestMain builds keel-edge from the repository into a temporary directory;
// each test starts its own edge on free loopback ports with the flags it needs
// and stops it with SIGTERM. Clients are github.com/eclipse/paho.golang (MQTT
// 5), github.com/eclipse/paho.mqtt.golang (MQTT 3.1.1 and WebSocket), the
// mosquitto_pub and mosquitto_sub tools, and a raw packet client for exact
// reason codes and malformed input.
//
// Environment:
//
//	KEEL_CONFORMANCE_ADDR     host:port of an already running broker (for
//	                          example Mosquitto, to validate the tests
//	                          themselves); tests that need edge flags skip
//	KEEL_CONFORMANCE_WS_ADDR  host:port of that broker's WebSocket listener
//	                          (path /mqtt); WebSocket tests skip without it
//	KEEL_CONFORMANCE_EDGE_BIN a prebuilt keel-edge to use instead of building
//	KEEL_CONFORMANCE_RACE     1: build keel-edge with -race, 0: without;
//	                          unset: with -race when the tests run with it
//	                          (make test, CI)
//
// Under -short every test skips.
package conformance
