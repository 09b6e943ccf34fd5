//go:build race

package conformance

// raceEnabled: this test binary runs under the race detector, and so does
// the keel-edge it builds.
const raceEnabled = true
