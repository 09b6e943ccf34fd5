package cluster

import (
	"strconv"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// retainAcked publishes a retained message (a clear when payload is
// empty) at QoS 1 on addr and waits for its PUBACK.
func retainAcked(t *testing.T, addr, topic string, payload []byte) {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	defer c.Conn.Close()
	c.Connect("retainer", true, packets.Properties{})
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, PacketID: 1,
		TopicName: topic, Payload: payload})
	require.Equal(t, uint16(1), c.Expect(packets.Puback).PacketID)
}

// retainedMarker is a retained topic a reader subscribes to after its
// filter, in the same SUBSCRIBE: its message comes after every retained
// message of the filter, so a reader knows when it got them all.
const retainedMarker = "marker/end"

// retainedOn subscribes a new client on addr to filter and returns the
// payloads of the retained messages it gets for it.
func retainedOn(t *testing.T, addr, filter string, reader int) []string {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	defer c.Conn.Close()
	c.Connect("reader-"+strconv.Itoa(reader), true, packets.Properties{})
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: filter, Qos: 1}, {Filter: retainedMarker, Qos: 1}}})
	require.Equal(t, []byte{1, 1}, c.Expect(packets.Suback).ReasonCodes)
	var got []string
	for {
		pk := c.Expect(packets.Publish) // those that came before the SUBACK first
		require.True(t, pk.FixedHeader.Retain)
		c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		if pk.TopicName == retainedMarker {
			return got
		}
		got = append(got, string(pk.Payload))
	}
}

// Retained messages are the cluster's, not an edge's: one cleared or
// replaced on another edge, which had no subscriber to tell this one, is
// not served from this edge's memory [MQTT-3.3.1-6] [MQTT-3.3.1-7].
func TestCluster_RetainedChangedOnAnotherEdge(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b")
	a, b := c.edges["edge-a"], c.edges["edge-b"]
	retainAcked(t, a.mqtt, retainedMarker, []byte("end"))

	retainAcked(t, a.mqtt, "state/lamp", []byte("on"))
	retainAcked(t, a.mqtt, "state/fan", []byte("slow"))
	require.ElementsMatch(t, []string{"on", "slow"}, retainedOn(t, b.mqtt, "state/#", 1))

	retainAcked(t, b.mqtt, "state/lamp", nil)
	retainAcked(t, b.mqtt, "state/fan", []byte("fast"))
	require.Equal(t, []string{"fast"}, retainedOn(t, a.mqtt, "state/#", 2), "edge A, which stored both, follows edge B's changes")
	require.Equal(t, []string{"fast"}, retainedOn(t, a.mqtt, "state/fan", 3))
	require.Empty(t, retainedOn(t, a.mqtt, "state/lamp", 4))
}
