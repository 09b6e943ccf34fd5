//go:build !race

package conformance

// raceEnabled: this test binary runs without the race detector.
const raceEnabled = false
