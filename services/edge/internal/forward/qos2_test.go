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

	publish := publishUnacknowledged(t, a.mqtt, "C")
	got := sub.Expect(packets.Publish)
	require.Equal(t, []byte("once"), got.Payload)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: got.PacketID})
	sub.Expect(packets.Pubrel)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubcomp}, PacketID: got.PacketID})

	// Edge C's routes are gone now; the client comes back and sends the
	// message again.
	routes.setEdges(Peer{ID: "edge-b", URL: b.api.URL})
	pub := mqtttest.Dial(t, a.mqtt, 4)
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

// A QoS 2 publish for a shared group with members on two edges, not
// acknowledged because a third edge did not take it, is sent again by its
// client: the resend goes to the edge the first copy went to (whose
// member has it already), not to the group's other edge in turn, whose
// member would get it a second time.
func TestForward_QoS2GroupResendGoesToTheSameEdge(t *testing.T) {
	t.Parallel()
	a, b, c, gone := startEdge(t, "edge-a"), startEdge(t, "edge-b"), startEdge(t, "edge-c"), startEdge(t, "edge-d")
	goneURL := gone.api.URL
	gone.api.Close() // edge D takes nothing
	group := GroupRoute{Name: "g", Filter: "t/x", Edges: []Peer{{ID: "edge-b", URL: b.api.URL}, {ID: "edge-c", URL: c.api.URL}}}
	routes := &switchRoutes{}
	routes.set(Route{Edges: []Peer{{ID: "edge-d", URL: goneURL}}, Groups: []GroupRoute{group}}, "")
	_, inc := a.b.ID()
	runForwarder(t, a, &Forwarder{Self: "edge-a", Incarnation: func() uint64 { return inc }, Resolver: routes,
		Bound: time.Second, Logger: testutil.Logger(t)})
	var members []*mqtttest.Client
	for _, e := range []*edge{b, c} {
		m := mqtttest.Dial(t, e.mqtt, 5)
		m.Connect("member", true, packets.Properties{})
		require.Equal(t, []byte{2}, m.Subscribe(1, "$share/g/t/x", 2).ReasonCodes)
		members = append(members, m)
	}

	publish := publishUnacknowledged(t, a.mqtt, "D")

	// Edge D's routes are gone now; the client comes back and sends the
	// message again.
	routes.set(Route{Groups: []GroupRoute{group}}, "")
	pub := mqtttest.Dial(t, a.mqtt, 4)
	require.True(t, pub.Connect("pub", false, packets.Properties{}).SessionPresent)
	publish.FixedHeader.Dup = true
	pub.Send(publish)
	require.Equal(t, uint16(7), pub.Expect(packets.Pubrec).PacketID)

	got := 0
	for _, m := range members {
		for {
			pk, err := m.Read(500 * time.Millisecond)
			if err != nil {
				break
			}
			require.Equal(t, packets.Publish, pk.FixedHeader.Type)
			got++
		}
	}
	require.Equal(t, 1, got, "one member of the group gets it, once")
}

// publishUnacknowledged publishes "once" on t/x at QoS 2 (packet ID 7) from
// a persistent session at addr, and reads until the edge disconnects it
// without a PUBREC, as it must while edge missing has not taken the
// message. It returns the PUBLISH, for the client to send again.
func publishUnacknowledged(t *testing.T, addr, missing string) packets.Packet {
	t.Helper()
	publish := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, PacketID: 7,
		TopicName: "t/x", Payload: []byte("once")}
	pub := mqtttest.Dial(t, addr, 4)
	pub.Connect("pub", false, packets.Properties{}) // a persistent session: it resends
	pub.Send(publish)
	for {
		pk, err := pub.Read(5 * time.Second)
		if err != nil {
			return publish // disconnected unacknowledged
		}
		require.NotEqual(t, packets.Pubrec, pk.FixedHeader.Type, "acknowledged although edge "+missing+" did not take it")
	}
}
