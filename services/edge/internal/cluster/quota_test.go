package cluster

import (
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// TestSharedStore_TenantQueueQuota: with the persistence service (on
// Redis) bounding the tenant's queued entries (3), messages for its offline
// sessions are queued until the bound and then dropped for the session that
// would go past it, counted, while the publisher is acknowledged every
// time. The sessions resume with exactly what was stored and stay connected
// (a delivery the store had refused would make its send fail); deliveries
// to a connected session are not bounded, at the bound either. A session
// that reconnects while publishers keep sending to it (its queueing still
// being answered when its client is back) is never disconnected for it, and
// every acknowledged message reaches it or is counted as dropped.
func TestSharedStore_TenantQueueQuota(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster processes: skipped under -short")
	}
	c := startSharedClusterWith(t, []string{"--queue.tenant-max", "3", "--redis.addr", startRedisServer(t),
		"--redis.min-replicas", "0", "--unreplicated"}, "a")
	a := c.edges["a"]
	dropped := func() float64 {
		return testutil.MetricSum(t, a.ops, "keel_edge_messages_dropped_total", map[string]string{"cause": "tenant_queue_quota"})
	}
	s1 := persistentSubscriber(t, a.mqtt, "s1", "q1", a.mqtt, "first-1")
	s2 := persistentSubscriber(t, a.mqtt, "s2", "q2", a.mqtt, "first-2")
	for _, s := range []*mqtttest.Client{s1, s2} {
		s.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	}
	require.Eventually(t, func() bool { return testutil.Metric(t, a.ops, "keel_edge_connections") == 0 }, 10*time.Second, 20*time.Millisecond)

	for _, m := range []struct{ topic, payload string }{{"q1/x", "q1-1"}, {"q1/x", "q1-2"}, {"q2/x", "q2-1"}, {"q2/x", "q2-2"}, {"q1/x", "q1-3"}} {
		publishAcked(t, a.mqtt, m.topic, []byte(m.payload), 10*time.Second)
	}
	require.Equal(t, 2.0, dropped(), "q2-2 and q1-3 went past the bound")

	r1 := connectResumed(t, a.mqtt, "s1", 10*time.Second)
	require.Equal(t, []string{"q1-1", "q1-2"}, receive(t, r1, []string{"q1-1", "q1-2"}))
	// s2 is offline: q2-1, q2-3 and q2-4 fill the bound again, q2-5 is
	// dropped; connected s1 takes more than the bound meanwhile.
	for _, p := range []string{"q2-3", "q2-4", "q2-5"} {
		publishAcked(t, a.mqtt, "q2/x", []byte(p), 10*time.Second)
	}
	require.Equal(t, 3.0, dropped())
	want := []string{"q1-4", "q1-5", "q1-6", "q1-7"}
	for _, p := range want {
		publishAcked(t, a.mqtt, "q1/x", []byte(p), 10*time.Second)
	}
	require.Equal(t, want, receive(t, r1, want))
	require.Equal(t, 3.0, dropped(), "a connected session is not bounded")

	// s2 comes back again and again while four publishers keep sending to
	// it: at the bound while it is away, queued or sent when it is back.
	var mu sync.Mutex
	acked, got := map[string]bool{}, map[string]bool{"q2-1": true, "q2-3": true, "q2-4": true}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for p := range 4 {
		pub := mqtttest.Dial(t, a.mqtt, 5)
		pub.Connect("pub-"+strconv.Itoa(p), true, packets.Properties{})
		wg.Go(func() {
			for n := 1; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				payload := fmt.Sprintf("p%d-%d", p, n)
				pub.Publish(uint16(n%60000+1), "q2/x", 1, []byte(payload))
				pk, err := pub.Read(10 * time.Second)
				if err != nil || pk.FixedHeader.Type != packets.Puback {
					t.Errorf("publisher %d: %q not acknowledged: %v %v", p, payload, pk.FixedHeader.Type, err)
					return
				}
				mu.Lock()
				acked[payload] = true
				mu.Unlock()
			}
		})
	}
	readFor := func(s *mqtttest.Client, d time.Duration) error {
		for deadline := time.Now().Add(d); time.Now().Before(deadline); {
			pk, err := s.Read(time.Until(deadline))
			if err != nil {
				if time.Now().After(deadline) {
					return nil
				}
				return err
			}
			switch pk.FixedHeader.Type {
			case packets.Publish:
				mu.Lock()
				got[string(pk.Payload)] = true
				mu.Unlock()
				s.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			case packets.Disconnect:
				return fmt.Errorf("disconnected by the edge: reason 0x%x", pk.ReasonCode)
			}
		}
		return nil
	}
	for range 10 {
		time.Sleep(150 * time.Millisecond) // offline: queued to the bound, then dropped
		r2 := connectResumed(t, a.mqtt, "s2", 10*time.Second)
		require.NoError(t, readFor(r2, 300*time.Millisecond), "s2 stays connected")
		r2.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
		_ = r2.Conn.Close()
	}
	close(stop)
	wg.Wait()
	r2 := connectResumed(t, a.mqtt, "s2", 10*time.Second)
	require.NoError(t, readFor(r2, 2*time.Second))
	mu.Lock()
	defer mu.Unlock()
	var lost []string
	for p := range acked {
		if !got[p] {
			lost = append(lost, p)
		}
	}
	require.Positive(t, dropped()-3, "the bound dropped some while s2 was away")
	require.Equal(t, float64(len(lost)), dropped()-3, "every acknowledged message not delivered is counted as dropped (%d acknowledged, %d delivered)", len(acked), len(got))
}
