package broker

import (
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// The edge's metrics count what happened: connections, connects by
// result, messages and bytes in and out by QoS, QoS 1/2 messages in
// flight to a client that has not acknowledged them, and retained
// messages.
func TestBroker_MetricValues(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("metrics-sub", true, packets.Properties{})
	sub.Subscribe(1, "m/#", 2)
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("metrics-pub", true, packets.Properties{})
	// Counted as the session is bound, which may come just after the CONNACK.
	require.Eventually(t, func() bool {
		return promtest.ToFloat64(b.m.connections) == 2 && promtest.ToFloat64(b.m.connects.WithLabelValues("ok")) == 2
	}, 5*time.Second, 10*time.Millisecond, "two connections, two connects")

	pub.Publish(0, "m/q", 0, make([]byte, 10))
	pub.Publish(1, "m/q", 1, make([]byte, 20))
	pub.Expect(packets.Puback)
	pub.Publish(2, "m/q", 2, make([]byte, 30))
	pub.Expect(packets.Pubrec)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 2})
	pub.Expect(packets.Pubcomp)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true}, PacketID: 3,
		TopicName: "m/kept", Payload: make([]byte, 8)})
	pub.Expect(packets.Puback)
	var outBytes [3]int
	for range 4 {
		got := sub.Expect(packets.Publish) // QoS 1 and 2 left unacknowledged
		outBytes[got.FixedHeader.Qos] += len(got.Payload)
	}

	in := map[string][2]float64{"0": {1, 10}, "1": {2, 28}, "2": {1, 30}}
	for q, want := range in {
		require.Equal(t, want[0], promtest.ToFloat64(b.m.messagesIn.WithLabelValues(q)), "messages in, qos %s", q)
		require.Equal(t, want[1], promtest.ToFloat64(b.m.bytesIn.WithLabelValues(q)), "bytes in, qos %s", q)
		require.Equal(t, want[0], promtest.ToFloat64(b.m.messagesOut.WithLabelValues(q)), "messages out, qos %s", q)
		// PUBLISH bytes: the payload and the packet's header.
		require.Greater(t, promtest.ToFloat64(b.m.bytesOut.WithLabelValues(q)), want[1], "bytes out, qos %s", q)
	}
	require.Equal(t, [3]int{10, 28, 30}, outBytes)
	require.Equal(t, 1.0, promtest.ToFloat64(b.m.retained))
	require.Eventually(t, func() bool { return promtest.ToFloat64(b.m.inflight) == 3 }, 5*time.Second, 10*time.Millisecond,
		"three QoS 1/2 deliveries unacknowledged")
}
