package broker

import (
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A connection is bound to its session's copy after its CONNACK went out.
// If the copy ends in between for a newer holder (here: the edge's lease
// lapsed and it dropped the sessions it held), the connection must not
// open that copy again: the edge no longer holds it, so nothing routed
// here would reach the client, and the session's holder could not tell
// the client was here. It goes with 0x8E instead, and reconnects to
// wherever the session is now.
func TestBroker_ConnectionNotBoundToACopyThatEndedBeforeItsBind(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
	addr := serveTCP(t, b)
	const client = "bind-gone"
	id := b.mustScope(t, "default").ClientID(client)

	first := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, first.Connect(client, false, persistentSession).ReasonCode)
	waitBound(t, b, id)
	first.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	waitUnbound(t, b.session(id), "a persistent session stays, offline, after its DISCONNECT")

	var once sync.Once
	dropped := make(chan int, 1)
	drop := func(at string) {
		if at == id {
			once.Do(func() { dropped <- b.DropLapsedSessions() })
		}
	}
	b.atBind.Store(&drop)

	second := mqtttest.Dial(t, addr, 5)
	ack := second.Connect(client, false, persistentSession)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	select {
	case n := <-dropped:
		require.Equal(t, 1, n, "the session's copy was dropped before the bind")
	case <-time.After(5 * time.Second):
		t.Fatal("the connection never came to its bind")
	}
	pk, err := second.Read(5 * time.Second)
	require.NoError(t, err, "the connection stayed open on a copy the edge no longer holds")
	require.Equal(t, packets.Disconnect, pk.FixedHeader.Type)
	require.Equal(t, packets.ErrSessionTakenOver.Code, pk.ReasonCode)
	require.Nil(t, b.session(id), "no copy of the session is held here")
}
