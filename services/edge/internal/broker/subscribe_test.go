package broker

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// subscriptionGate is a real durable store whose PutSubscription the test
// holds (until release is closed) or fails (while fail is set).
type subscriptionGate struct {
	*durable.Store
	entered chan struct{} // one value per PutSubscription that started
	release chan struct{}
	once    sync.Once
	fail    atomic.Bool
}

func (s *subscriptionGate) open() { s.once.Do(func() { close(s.release) }) }

func (s *subscriptionGate) PutSubscription(ctx context.Context, id string, sub durable.Subscription) error {
	s.entered <- struct{}{}
	<-s.release
	if s.fail.Load() {
		return errors.New("injected store failure")
	}
	return s.Store.PutSubscription(ctx, id, sub)
}

func servingOnGate(t *testing.T) (*Broker, *durable.Store, *subscriptionGate, string) {
	t.Helper()
	gate := &subscriptionGate{entered: make(chan struct{}, 16), release: make(chan struct{})}
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState { gate.Store = st; return gate })
	t.Cleanup(gate.open) // before the broker closes: a failed test does not hang
	addr := serveTCP(t, b)
	return b, st, gate, addr
}

var persistentSession = packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true}

// A subscription of a durable session matches this edge's publishes from
// the moment the SUBSCRIBE is read, while its record is still being
// stored: another client's publish in that time is delivered, before the
// SUBACK (§3.8.4 allows it). The SUBACK waits for the store.
func TestBroker_SubscriptionMatchesBeforeItsSuback(t *testing.T) {
	t.Parallel()
	_, _, gate, addr := servingOnGate(t)

	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("early", false, persistentSession)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "early/#", Qos: 1}}})
	select {
	case <-gate.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the subscription was never stored")
	}

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("early-pub", true, packets.Properties{})
	pub.Publish(1, "early/x", 1, []byte("before the suback"))
	require.Equal(t, packets.Puback, pub.Expect(packets.Puback).FixedHeader.Type)

	pk, err := sub.Read(5 * time.Second)
	require.NoError(t, err)
	require.Equal(t, packets.Publish, pk.FixedHeader.Type, "the publish arrives while the SUBACK waits for the store")
	require.Equal(t, "early/x", pk.TopicName)
	require.Equal(t, "before the suback", string(pk.Payload))
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})

	gate.open()
	ack := sub.Expect(packets.Suback)
	require.Equal(t, []byte{1}, ack.ReasonCodes)
}

// A subscription of a durable session that the store did not keep is
// refused (0x80, so that the client may try again) rather than granted
// for this connection only: it leaves the index, and matches nothing.
// The next SUBSCRIBE of the same filter is granted and stored.
func TestBroker_SubscriptionNotStoredIsRefused(t *testing.T) {
	t.Parallel()
	b, st, gate, addr := servingOnGate(t)
	gate.open()
	gate.fail.Store(true)

	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("unstored", false, persistentSession)
	ack := sub.Subscribe(1, "unstored/#", 1)
	require.Equal(t, []byte{packets.ErrUnspecifiedError.Code}, ack.ReasonCodes)
	require.NotEmpty(t, ack.Properties.ReasonString)

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("unstored-pub", true, packets.Properties{})
	pub.Publish(1, "unstored/x", 1, []byte("nobody subscribed"))
	pub.Expect(packets.Puback)
	_, err := sub.Read(300 * time.Millisecond)
	require.Error(t, err, "a refused subscription matches nothing")

	id := b.mustScope(t, "default").ClientID("unstored")
	stored, ok, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok)
	require.Empty(t, stored.Subs)

	gate.fail.Store(false)
	ack = sub.Subscribe(2, "unstored/#", 1)
	require.Equal(t, []byte{1}, ack.ReasonCodes)
	pub.Publish(2, "unstored/x", 1, []byte("now subscribed"))
	pub.Expect(packets.Puback)
	got := sub.Expect(packets.Publish)
	require.Equal(t, "now subscribed", string(got.Payload))
	stored, _, err = st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.Len(t, stored.Subs, 1)

	// A replacement the store did not keep is refused, and the
	// subscription it would have replaced stays in force (QoS 1).
	gate.fail.Store(true)
	ack = sub.Subscribe(3, "unstored/#", 2)
	require.Equal(t, []byte{packets.ErrUnspecifiedError.Code}, ack.ReasonCodes)
	pub.Publish(3, "unstored/x", 2, []byte("old subscription"))
	pub.Expect(packets.Pubrec)
	got = sub.Expect(packets.Publish)
	require.Equal(t, "old subscription", string(got.Payload))
	require.Equal(t, byte(1), got.FixedHeader.Qos, "delivered under the subscription that stayed")
	stored, _, err = st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.Len(t, stored.Subs, 1)
	require.Equal(t, byte(1), stored.Subs[0].QoS)
}
