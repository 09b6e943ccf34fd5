package broker

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// heldOfflineQueueing is a real durable store whose queueing for offline
// sessions is answered when the test says (as the persistence service
// answers it, late, under a tenant's bound), and whose next Send can be
// made to fail.
type heldOfflineQueueing struct {
	*durable.Store
	mu       sync.Mutex
	held     []chan error
	failSend error
	sends    int
}

func (s *heldOfflineQueueing) Enqueue(id string, e durable.Entry) *durable.Pending {
	if !e.Offline {
		return s.Store.Enqueue(id, e)
	}
	done := make(chan error, 1)
	s.mu.Lock()
	s.held = append(s.held, done)
	s.mu.Unlock()
	return durable.NewPending(done)
}

func (s *heldOfflineQueueing) Send(id string, entries []durable.Entry) *durable.Pending {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sends++
	if err := s.failSend; err != nil {
		s.failSend = nil
		return durable.DonePending(err)
	}
	return s.Store.Send(id, entries)
}

func (s *heldOfflineQueueing) heldCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.held)
}

func (s *heldOfflineQueueing) sendCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sends
}

// answer answers the held queueing (refused, for example) as the store
// would have. A refused one stored nothing; an accepted one is stored here.
func (s *heldOfflineQueueing) answer(err error) {
	s.mu.Lock()
	held := s.held
	s.held = nil
	s.mu.Unlock()
	for _, c := range held {
		c <- err
	}
}

// offlineSubscriberOnHeldStore serves a broker (configured by mutate) on a
// heldOfflineQueueing store, with the persistent session "sub" subscribed
// to q/x at qos and offline.
func offlineSubscriberOnHeldStore(t *testing.T, mutate func(*Config), qos byte) (*Broker, *heldOfflineQueueing, string) {
	t.Helper()
	var st *heldOfflineQueueing
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState {
		st = &heldOfflineQueueing{Store: s}
		return st
	})
	if mutate != nil {
		mutate(&b.cfg)
	}
	addr := serveTCP(t, b)
	sub := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, sub.Connect("sub", false, persistentProps).ReasonCode)
	sub.Subscribe(1, "q/x", qos)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	require.Eventually(t, func() bool {
		s := b.session(b.mustScope(t, "default").ClientID("sub"))
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.client == nil
	}, 5*time.Second, 5*time.Millisecond, "the session goes offline")
	return b, st, addr
}

// A delivery the writer takes while its queueing for the offline session
// is still unanswered is sent with its message stored first; what the
// publisher is told then follows what that send stored, not the queueing
// alone:
//   - refused by the tenant's bound, and the send failed too: nothing is
//     stored, so the message is a counted drop (acknowledged to its
//     publisher, as every drop by a bound), not an acknowledged message
//     silently lost;
//   - the queueing failed (the store unavailable), but the send stored the
//     message and the client got it: the session has it, and the publisher
//     is acknowledged rather than told to send again (which would deliver
//     a QoS 2 message twice).
func TestSession_StoreFirstSendDecides(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		queueing   error
		send       error
		delivered  bool
		notAcked   bool // the publisher is told to send again
		quotaDrops float64
	}{
		{name: "refused and send failed", queueing: durable.ErrQueueQuota, send: errors.New("injected send failure"), quotaDrops: 1},
		{name: "queueing failed and send stored", queueing: errors.New("injected store failure"), delivered: true},
		{name: "refused and send stored", queueing: durable.ErrQueueQuota, delivered: true},
		{name: "queueing failed and send failed", queueing: errors.New("injected store failure"), send: errors.New("injected send failure"), notAcked: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, st, addr := offlineSubscriberOnHeldStore(t, nil, 2)

			pub := mqtttest.Dial(t, addr, 5)
			pub.Connect("pub", true, packets.Properties{})
			pub.Publish(1, "q/x", 2, []byte("m1"))
			require.Eventually(t, func() bool { return st.heldCount() == 1 }, 5*time.Second, time.Millisecond)

			// The client comes back before the store answers the queueing:
			// the writer takes the message and sends it, stored first.
			st.mu.Lock()
			st.failSend = tc.send
			st.mu.Unlock()
			back := mqtttest.Dial(t, addr, 5)
			require.Equal(t, packets.CodeSuccess.Code, back.Connect("sub", false, persistentProps).ReasonCode)
			require.Eventually(t, func() bool { return st.sendCount() == 1 }, 5*time.Second, time.Millisecond)
			st.answer(tc.queueing)

			if tc.notAcked {
				// Stored nowhere: the publisher is closed unacknowledged
				// and sends it again.
				pk, err := pub.Read(5 * time.Second)
				if err == nil {
					require.Equal(t, packets.Disconnect, pk.FixedHeader.Type, "got packet type %d reason 0x%x", pk.FixedHeader.Type, pk.ReasonCode)
				}
			} else {
				ack := pub.Expect(packets.Pubrec)
				require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode, "the publisher is acknowledged: the message was taken or dropped by the bound")
			}
			require.Equal(t, tc.quotaDrops, promtest.ToFloat64(b.m.dropped.WithLabelValues("tenant_queue_quota")))
			if tc.delivered {
				pk := back.Expect(packets.Publish)
				require.Equal(t, "m1", string(pk.Payload))
				return
			}
			expectNothing(t, back, 300*time.Millisecond)
			// A failed send stops the client; back again on this edge, it
			// is not sent from memory what was stored nowhere.
			again := mqtttest.Dial(t, addr, 5)
			require.Equal(t, packets.CodeSuccess.Code, again.Connect("sub", false, persistentProps).ReasonCode)
			expectNothing(t, again, 300*time.Millisecond)
		})
	}
}

// A session's own drop-oldest that pops a delivery whose queueing is still
// unanswered frees nothing the tenant's bound can count on: the newer
// delivery stays held to the bound, and the popped one's refusal is not
// counted a second time (the session's own bound dropped it already).
func TestSession_DropOldestOfUnansweredQueueing(t *testing.T) {
	t.Parallel()
	b, st, addr := offlineSubscriberOnHeldStore(t, func(c *Config) {
		c.OfflineQueueLen, c.OfflineDropOldest, c.QueueLen = 1, true, 1
	}, 1)

	var pubs []*mqtttest.Client
	for i, payload := range []string{"m1", "m2"} {
		pub := mqtttest.Dial(t, addr, 5)
		pub.Connect("pub-"+payload, true, packets.Properties{})
		pub.Publish(1, "q/x", 1, []byte(payload))
		require.Eventually(t, func() bool { return st.heldCount() == i+1 }, 5*time.Second, time.Millisecond,
			"%s is queued held to the tenant's bound", payload)
		pubs = append(pubs, pub)
	}
	st.answer(durable.ErrQueueQuota)
	for _, pub := range pubs {
		require.Equal(t, packets.CodeSuccess.Code, pub.Expect(packets.Puback).ReasonCode)
	}
	require.Equal(t, 1.0, promtest.ToFloat64(b.m.dropped.WithLabelValues("offline_queue_full")), "m1, popped for m2")
	require.Equal(t, 1.0, promtest.ToFloat64(b.m.dropped.WithLabelValues("tenant_queue_quota")), "m2 only")
}
