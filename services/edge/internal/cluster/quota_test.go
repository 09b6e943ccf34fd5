package cluster

import (
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
)

// TestSharedStore_TenantQueueQuota: with the persistence service bounding
// the tenant's queued entries (3), messages for its offline sessions are
// queued until the bound and then dropped for the session that would go
// past it, counted, while the publisher is acknowledged every time. The
// sessions resume with exactly what was stored and stay connected (a
// delivery the store had refused would make the send fail); deliveries to a
// connected session are not bounded.
func TestSharedStore_TenantQueueQuota(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster processes: skipped under -short")
	}
	c := startSharedClusterWith(t, []string{"--queue.tenant-max", "3"}, "a")
	a := c.edges["a"]
	s1 := persistentSubscriber(t, a.mqtt, "s1", "q1", a.mqtt, "first-1")
	s2 := persistentSubscriber(t, a.mqtt, "s2", "q2", a.mqtt, "first-2")
	for _, s := range []interface{ Send(packets.Packet) }{s1, s2} {
		s.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	}
	require.Eventually(t, func() bool { return testutil.Metric(t, a.ops, "keel_edge_connections") == 0 }, 10*time.Second, 20*time.Millisecond)

	for _, m := range []struct{ topic, payload string }{{"q1/x", "q1-1"}, {"q1/x", "q1-2"}, {"q2/x", "q2-1"}, {"q2/x", "q2-2"}, {"q1/x", "q1-3"}} {
		publishAcked(t, a.mqtt, m.topic, []byte(m.payload), 10*time.Second)
	}
	dropped := map[string]string{"cause": "tenant_queue_quota"}
	require.Equal(t, 2.0, testutil.MetricSum(t, a.ops, "keel_edge_messages_dropped_total", dropped), "q2-2 and q1-3 went past the bound")

	r1 := connectResumed(t, a.mqtt, "s1", 10*time.Second)
	require.Equal(t, []string{"q1-1", "q1-2"}, receive(t, r1, []string{"q1-1", "q1-2"}))
	r2 := connectResumed(t, a.mqtt, "s2", 10*time.Second)
	require.Equal(t, []string{"q2-1"}, receive(t, r2, []string{"q2-1"}))

	// Connected, the sessions take more than the bound, and nothing more
	// is dropped.
	var want []string
	for _, p := range []string{"q2-3", "q2-4", "q2-5", "q2-6"} {
		publishAcked(t, a.mqtt, "q2/x", []byte(p), 10*time.Second)
		want = append(want, p)
	}
	require.Equal(t, want, receive(t, r2, want))
	require.Equal(t, 2.0, testutil.MetricSum(t, a.ops, "keel_edge_messages_dropped_total", dropped))
	_, err := r1.Read(300 * time.Millisecond)
	require.ErrorContains(t, err, "timeout", "s1 got nothing more and is still connected")
}
