package forward

import (
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A QoS 2 publish that one edge took and another did not is not
// acknowledged; the client's resend is routed under the msgID of the first
// copy, so the subscriber on the edge that took it gets it once.
func TestForward_QoS2ResendAfterPartialForwardDeliveredOnce(t *testing.T) {
	t.Parallel()
	a, b, gone := startEdge(t, "edge-a"), startEdge(t, "edge-b"), startEdge(t, "edge-c")
	goneURL := gone.api.URL
	gone.api.Close() // edge C takes nothing
	routes := &switchRoutes{}
	routes.setEdges(Peer{ID: "edge-b", URL: b.api.URL}, Peer{ID: "edge-c", URL: goneURL})
	_, inc := a.b.ID()
	runForwarder(t, a, &Forwarder{Self: "edge-a", Incarnation: func() uint64 { return inc }, Resolver: routes,
		Bound: time.Second, Logger: testutil.Logger(t)})

	sub := mqtttest.Dial(t, b.mqtt, 5)
	sub.Connect("sub", true, packets.Properties{})
	require.Equal(t, []byte{2}, sub.Subscribe(1, "t/x", 2).ReasonCodes)

	publish := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, PacketID: 7,
		TopicName: "t/x", Payload: []byte("once")}
	pub := mqtttest.Dial(t, a.mqtt, 4)
	pub.Connect("pub", false, packets.Properties{}) // a persistent session: it resends
	pub.Send(publish)
	for {
		pk, err := pub.Read(5 * time.Second)
		if err != nil {
			break // disconnected unacknowledged
		}
		require.NotEqual(t, packets.Pubrec, pk.FixedHeader.Type, "acknowledged although edge C did not take it")
	}
	got := sub.Expect(packets.Publish)
	require.Equal(t, []byte("once"), got.Payload)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: got.PacketID})
	sub.Expect(packets.Pubrel)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: got.PacketID})

	// Edge C's routes are gone now; the client comes back and sends the
	// message again.
	routes.setEdges(Peer{ID: "edge-b", URL: b.api.URL})
	pub = mqtttest.Dial(t, a.mqtt, 4)
	require.True(t, pub.Connect("pub", false, packets.Properties{}).SessionPresent)
	publish.FixedHeader.Dup = true
	pub.Send(publish)
	require.Equal(t, uint16(7), pub.Expect(packets.Pubrec).PacketID)
	pk, err := sub.Read(500 * time.Millisecond)
	require.Error(t, err, "delivered twice: %v", pk)

	// A new message under the same packet ID is a new message.
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
	pub.Expect(packets.Pubcomp)
	publish.FixedHeader.Dup, publish.Payload = false, []byte("new")
	pub.Send(publish)
	require.Equal(t, []byte("new"), sub.Expect(packets.Publish).Payload)
}
