package broker

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// failingRetained is a real durable store whose retained writes fail while
// down is set.
type failingRetained struct {
	*durable.Store
	down *atomic.Bool
}

func (s failingRetained) PutRetained(ctx context.Context, m *durable.Message, wait bool) error {
	if s.down.Load() {
		return errors.New("injected store failure")
	}
	return s.Store.PutRetained(ctx, m, wait)
}

// A QoS 1/2 retained message the store did not take is not acknowledged:
// later subscribers elsewhere would never see it, its publisher told it
// was taken. The client sends it again; a QoS 0 one goes on, counted.
func TestBroker_RetainedNotStoredIsNotAcknowledged(t *testing.T) {
	t.Parallel()
	down := &atomic.Bool{}
	down.Store(true)
	b, st := brokerOnStore(t, func(st *durable.Store) DurableState { return failingRetained{Store: st, down: down} })
	addr := serveTCP(t, b)
	retained := func() []durable.Message {
		_, msgs, err := st.Load()
		require.NoError(t, err)
		return msgs
	}

	for _, qos := range []byte{1, 2} {
		pub := mqtttest.Dial(t, addr, 5)
		pub.Connect("pub", true, packets.Properties{})
		pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos, Retain: true}, PacketID: 1,
			TopicName: "state/x", Payload: []byte("on")})
		require.Equal(t, packets.ErrServerBusy.Code, pub.Expect(packets.Disconnect).ReasonCode, "qos %d", qos)
	}
	require.Empty(t, retained())
	require.Equal(t, 2.0, promtestutil.ToFloat64(b.m.retainedNotStored))

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Retain: true}, TopicName: "state/y", Payload: []byte("q0")})
	pub.Publish(2, "other", 1, []byte("after"))
	require.Equal(t, uint16(2), pub.Expect(packets.Puback).PacketID, "a QoS 0 retained message the store did not take closes nothing")
	require.Equal(t, 3.0, promtestutil.ToFloat64(b.m.retainedNotStored))

	down.Store(false)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, PacketID: 3,
		TopicName: "state/x", Payload: []byte("on")})
	require.Equal(t, uint16(3), pub.Expect(packets.Puback).PacketID)
	require.Len(t, retained(), 1)
}
