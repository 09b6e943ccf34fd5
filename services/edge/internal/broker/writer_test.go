package broker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
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

// heldSends is a real durable store whose next Send, once held, does not
// return until the test lets it: the writer that makes it is busy in the
// call, as on a store stream that takes no more for a while. With gated,
// that Send's answer then waits for the test too.
type heldSends struct {
	*durable.Store
	hold    atomic.Bool
	gated   bool
	entered chan struct{}
	release chan struct{}
	gate    chan struct{}
}

func (s *heldSends) Send(id string, entries []durable.Entry) *durable.Pending {
	if !s.hold.CompareAndSwap(true, false) {
		return s.Store.Send(id, entries)
	}
	close(s.entered)
	<-s.release
	stored := s.Store.Send(id, entries)
	if !s.gated {
		return stored
	}
	done := make(chan error, 1)
	go func() {
		err := stored.Wait(context.Background())
		<-s.gate
		done <- err
	}()
	return durable.NewPending(done)
}

// A takeover waits only two seconds for the old connection's writer. One
// busy for longer (here in a store call) is still running when the newer
// connection's bind resends the session's in-flight message, and what it
// takes next is for the newer connection:
//   - it takes nothing while the resends go out: the message published
//     meanwhile arrives after the resend [MQTT-4.6.0-2];
//   - its batch for the old connection fails once stored, and it goes on
//     for the newer one, whose batch it took meanwhile: that message
//     arrives without waiting for another publish or a reconnect.
func TestBroker_OldConnectionsWriterStillRunningAtATakeover(t *testing.T) {
	for _, gated := range []bool{false, true} {
		t.Run(fmt.Sprintf("old_batch_stored_later=%v", gated), func(t *testing.T) {
			t.Parallel()
			var held *heldSends
			b, _ := brokerOnStore(t, func(st *durable.Store) DurableState {
				held = &heldSends{Store: st, gated: gated,
					entered: make(chan struct{}), release: make(chan struct{}), gate: make(chan struct{})}
				return held
			})
			addr := serveTCP(t, b)
			props := packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}
			older := mqtttest.Dial(t, addr, 5)
			older.Connect("dev", false, props)
			older.Subscribe(1, "q", 1)
			s := b.session(b.mustScope(t, "default").ClientID("dev"))
			require.NotNil(t, s)

			// The old connection's writer takes "first" and stays in the store.
			held.hold.Store(true)
			require.NoError(t, b.Publish("default", "q", []byte("first"), 1, false))
			<-held.entered

			locked := func(f func() bool) func() bool {
				return func() bool {
					s.mu.Lock()
					defer s.mu.Unlock()
					return f()
				}
			}
			writing := locked(func() bool { return s.writing })
			hook := func() {
				// The resends are about to go out, with the old writer running.
				require.True(t, writing())
				if err := b.Publish("default", "q", []byte("second"), 1, false); err != nil {
					t.Error(err)
				}
				require.Eventually(t, locked(func() bool { return s.queue.len() == 1 }), 5*time.Second, time.Millisecond)
				close(held.release)
				if !gated {
					// It writes "first" to the old connection, which fails,
					// and takes nothing for the new one meanwhile.
					require.Eventually(t, func() bool { return !writing() }, 5*time.Second, time.Millisecond)
				}
			}
			b.atResend.Store(&hook)
			newer := mqtttest.Dial(t, addr, 5)
			require.True(t, newer.Connect("dev", false, props).SessionPresent)
			first := newer.Expect(packets.Publish)
			require.Equal(t, []byte("first"), first.Payload, "the resend first")
			require.True(t, first.FixedHeader.Dup)
			if gated {
				// "second" is taken for the newer connection behind the old
				// connection's batch, which is then stored.
				require.Eventually(t, locked(func() bool { return s.queue.len() == 0 }), 5*time.Second, time.Millisecond)
				close(held.gate)
			}
			second := newer.Expect(packets.Publish)
			require.Equal(t, []byte("second"), second.Payload)
			require.False(t, second.FixedHeader.Dup)
		})
	}
}
