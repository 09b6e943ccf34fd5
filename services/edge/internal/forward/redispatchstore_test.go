package forward

import (
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A group message whose member here went away is given to another member
// here after the frame that brought it was acknowledged. When that
// member's session is persistent, the message counts as taken, and its
// origin forgets it, only once it is stored; a store that fails the write
// leaves it with its origin, which still holds it.
func TestForward_SharedMessageGivenToAPersistentMemberLaterIsStoredBeforeItIsTaken(t *testing.T) {
	t.Parallel()
	a := startEdge(t, "edge-a")
	store := &flakyStore{}
	store.sendFails.Store(true) // the member's store is down: its send fails as well
	b := serveStored(t, "edge-b", store, true)

	f := connectForwarder(t, a, "edge-a")
	f.Resolver = groupRoutes{name: "g", filter: "t/+", to: []Peer{{ID: "edge-b", URL: b.api}}}
	f.Redispatch = a.b.RedispatchShared
	f.Metrics = NewMetrics(nil)
	p := &sharedPair{a: a, fwd: f}

	live := member(t, b.mqtt, "live")
	pub := mqtttest.Dial(t, a.mqtt, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t/x", 1, []byte("fail")) // the store fails its first write
	pub.Expect(packets.Puback)
	require.Equal(t, []string{"fail"}, readN(t, live, 1, false))
	require.Equal(t, 1.0, p.held())

	// A persistent member joins, and the first one goes: the message is
	// given to the new one, whose store write fails.
	keep := mqtttest.Dial(t, b.mqtt, 5)
	keep.Connect("keep", false, sessionProps)
	require.Equal(t, []byte{1}, keep.Subscribe(1, "$share/g/t/+", 1).ReasonCodes)
	_ = live.Conn.Close()
	require.Eventually(t, func() bool {
		for _, q := range store.enqueued() {
			if q == "fail" {
				return true
			}
		}
		return false
	}, 5*time.Second, time.Millisecond, "given to the persistent member")
	time.Sleep(300 * time.Millisecond)
	require.Zero(t, testutil.ToFloat64(f.Metrics.sharedOutcomes.WithLabelValues("acked")), "not stored, so not acknowledged to its origin")
	require.Equal(t, 1.0, p.held(), "its origin still holds it")
}
