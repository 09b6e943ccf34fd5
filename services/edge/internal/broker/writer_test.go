package broker

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// gatedSends is a real durable store whose Sends are answered only when
// the test opens their gate (with the error it gives).
type gatedSends struct {
	*durable.Store
	mu    sync.Mutex
	gates []chan error
	pass  bool // later Sends are answered at once
}

func (s *gatedSends) Send(id string, entries []durable.Entry) *durable.Pending {
	stored := s.Store.Send(id, entries)
	gate := make(chan error, 1)
	s.mu.Lock()
	if s.pass {
		gate <- nil
	}
	s.gates = append(s.gates, gate)
	s.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		err := stored.Wait(context.Background())
		if g := <-gate; g != nil {
			err = g
		}
		done <- err
	}()
	return durable.NewPending(done)
}

func (s *gatedSends) sends() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.gates)
}

func (s *gatedSends) open(i int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.gates[i] <- err
}

// servingGatedSends serves MQTT on a broker whose Sends wait for the test.
func servingGatedSends(t *testing.T) (*gatedSends, string) {
	t.Helper()
	var gated *gatedSends
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState {
		gated = &gatedSends{Store: st}
		return gated
	})
	addr := serveTCP(t, b)
	return gated, addr
}

// waitSends waits until n Sends were made.
func (s *gatedSends) waitSends(t *testing.T, n int) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, func() error {
		if got := s.sends(); got < n {
			return errors.New("fewer sends")
		}
		return nil
	})
}

// sendsStoredTogether serves a persistent subscriber of "t" and publishes
// four messages to it, the first alone: its Send is being stored while
// the others are queued.
func sendsStoredTogether(t *testing.T) (*gatedSends, string, *mqtttest.Client) {
	t.Helper()
	st, addr := servingGatedSends(t)
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("sub", false, packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	sub.Subscribe(1, "t", 1)
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t", 1, seqPayload(0))
	pub.Expect(packets.Puback)
	st.waitSends(t, 1)
	for i := 1; i < 4; i++ {
		pub.Publish(uint16(i+1), "t", 1, seqPayload(i))
		pub.Expect(packets.Puback)
	}
	return st, addr, sub
}

// A persistent session's writer stores the next batch's packet IDs while
// the one before is being stored, and writes each to the client only once
// it and every batch before it are stored: in order.
func TestSession_WriterStoresBatchesWhileEarlierOnesAreStored(t *testing.T) {
	t.Parallel()
	st, _, sub := sendsStoredTogether(t)
	st.waitSends(t, 2) // while the first is not stored yet
	expectNothing(t, sub, 100*time.Millisecond)
	for i := st.sends() - 1; i > 0; i-- {
		st.open(i, nil)
	}
	expectNothing(t, sub, 100*time.Millisecond) // the first batch is not stored: nothing after it goes
	st.open(0, nil)
	for i := range 4 {
		got := sub.Expect(packets.Publish)
		require.Equal(t, seqPayload(i), got.Payload, "message %d", i)
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
}

// When a batch's packet IDs are not stored, neither it nor any batch after
// it goes to the client, which is disconnected; resumed, the session
// delivers every message, in order.
func TestSession_WriterStopsAtABatchNotStored(t *testing.T) {
	t.Parallel()
	st, addr, sub := sendsStoredTogether(t)
	st.waitSends(t, 2)
	n := st.sends()
	for i := n - 1; i > 0; i-- {
		st.open(i, nil)
	}
	st.open(0, errors.New("injected store failure"))
	for {
		pk, err := sub.Read(5 * time.Second)
		if err != nil {
			break // disconnected
		}
		require.NotEqual(t, packets.Publish, pk.FixedHeader.Type, "a delivery went out behind one not stored")
	}

	st.mu.Lock()
	st.pass = true
	st.mu.Unlock()
	again := mqtttest.Dial(t, addr, 5)
	again.Connect("sub", false, packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	for i := range 4 {
		got := again.Expect(packets.Publish)
		require.Equal(t, seqPayload(i), got.Payload, "message %d", i)
		again.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
}

// A writer that can no longer write to its connection goes on for a newer
// connection of the session bound meanwhile, when something waits for it.
// A takeover waits only so long for the old connection's writer: the new
// connection's bind, and every message queued after it, found that writer
// running and left the queue to it.
func TestBroker_WriterThatLosesItsConnectionGoesOnForTheNewerOne(t *testing.T) {
	b, addr := startBroker(t, nil)
	sub, pub := subAndPub(t, addr, "t", 0, packets.Properties{})
	scope := b.mustScope(t, "default")
	s := b.session(scope.ClientID("sub"))
	require.NotNil(t, s)

	// A closed connection stands in for the session's older one, whose
	// writer is still running after the newer one's bind.
	older := mqtttest.Dial(t, addr, 5)
	older.Connect("older", true, packets.Properties{})
	olderCl, ok := b.server.Clients.Get(scope.ClientID("older"))
	require.True(t, ok)
	require.NoError(t, older.Conn.Close())
	require.Eventually(t, olderCl.Closed, 5*time.Second, time.Millisecond)
	s.mu.Lock()
	require.False(t, s.writing)
	s.writing = true
	s.mu.Unlock()

	pub.Publish(0, "t", 0, []byte("queued"))
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.queue.len() == 1
	}, 5*time.Second, time.Millisecond, "left to the running writer")

	w := newStoringBatch(olderCl)
	w.buf = append(w.buf, 0xd0, 0) // a PINGRESP
	require.False(t, s.flush(w), "the older connection is closed")
	w.release()
	require.Equal(t, []byte("queued"), sub.Expect(packets.Publish).Payload)
}
