package conformance

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"

	"github.com/stretchr/testify/require"
)

// TestConformance_ReceiveMaximum subscribes a client that announces Receive
// Maximum 3 and acknowledges slowly, and checks that the server never has
// more than three QoS 1 messages unacknowledged towards it, and still
// delivers all of them in order.
func TestConformance_ReceiveMaximum(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	const window, total = 3, 10
	topic := topicFor(t)
	cp := rawConnect("rm-" + uniq())
	cp.Properties.ReceiveMaximum = u16(window)
	rc, _ := connectRaw(t, e.TCP, cp)
	rc.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
		Subscriptions: []packets.SubOptions{{Topic: topic, QoS: 1}}})
	rc.expect(t, packets.SUBACK)

	pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
	want := payloads("m", total)
	for _, p := range want {
		pub.pub(t, topic, 1, p)
	}
	var unacked []uint16
	received := 0
	receive := func() {
		t.Helper()
		p, _ := rc.expectPublish(t)
		require.Equal(t, want[received], string(p.Payload), "[MQTT-4.6.0-6] in order")
		require.Equal(t, byte(1), p.QoS)
		unacked = append(unacked, p.PacketID)
		received++
	}
	for range window {
		receive()
	}
	// [MQTT-3.3.4-9]: no more than Receive Maximum unacknowledged QoS 1 PUBLISH.
	rc.expectSilence(t, 300*time.Millisecond)
	for received < total {
		rc.send(t, &packets.Puback{PacketID: unacked[0], Properties: &packets.Properties{}})
		unacked = unacked[1:]
		receive()
		rc.expectSilence(t, 50*time.Millisecond)
	}
}

// TestConformance_MaximumPacketSize checks both directions of Maximum Packet
// Size: the server drops a message too large for a client's limit, and
// closes the connection of a client that sends a packet larger than the
// server's limit.
func TestConformance_MaximumPacketSize(t *testing.T) {
	t.Parallel()
	t.Run("client_limit", func(t *testing.T) {
		t.Parallel()
		e := startEdge(t)
		topic := topicFor(t)
		cp := v5Connect("small-" + uniq())
		cp.Properties.MaximumPacketSize = u32(256)
		small := connectV5(t, e.TCP, cp)
		small.sub(t, topic, 1)
		large := connectV5(t, e.TCP, v5Connect("large-"+uniq()))
		large.sub(t, topic, 1)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		big := strings.Repeat("x", 1000)
		pub.pub(t, topic, 1, big)
		pub.pub(t, topic, 0, big)
		pub.pub(t, topic, 1, "ok")
		// [MQTT-3.1.2-24] never sent to the small client; [MQTT-3.1.2-25]
		// discarded as if sent, so later messages still flow.
		small.expectPayloads(t, "ok")
		large.expectPayloads(t, big, big, "ok")
		small.expectNothing(t, quiet)
	})
	t.Run("server_limit_announced", func(t *testing.T) {
		t.Parallel()
		e := startEdge(t, "--mqtt.max-packet-size", "1024")
		_, ca := connectRaw(t, e.TCP, rawConnect("c-"+uniq()))
		// §3.2.2.3.6: without a Maximum Packet Size in CONNACK there is no
		// limit beyond the protocol's, so a server that enforces one says so.
		require.NotNil(t, ca.Properties.MaximumPacketSize, "CONNACK Maximum Packet Size")
		require.Equal(t, uint32(1024), *ca.Properties.MaximumPacketSize)
	})
	t.Run("server_limit_is_the_whole_packet", func(t *testing.T) {
		t.Parallel()
		// §3.2.2.3.6: the Maximum Packet Size is the total number of bytes
		// in the packet, fixed header and length bytes included. A PUBLISH
		// of exactly the limit is accepted, one byte more is not.
		e := startEdge(t, "--mqtt.max-packet-size", "1024")
		topic := topicFor(t)
		sized := func(total int, id uint16) []byte {
			// fixed header (1) + remaining length (2 bytes for 128..16383)
			// + topic length (2) + topic + packet ID (2) + properties (1).
			n := total - 3 - 2 - len(topic) - 2 - 1
			body := append([]byte{byte(len(topic) >> 8), byte(len(topic))}, topic...)
			body = append(body, byte(id>>8), byte(id), 0x00)
			body = append(body, strings.Repeat("p", n)...)
			rl := len(body)
			pkt := append([]byte{0x32, byte(rl&0x7f | 0x80), byte(rl >> 7)}, body...)
			require.Len(t, pkt, total)
			return pkt
		}
		rc, _ := connectRaw(t, e.TCP, rawConnect("edge-"+uniq()))
		rc.sendBytes(t, sized(1024, 1))
		require.Less(t, rc.expect(t, packets.PUBACK).Content.(*packets.Puback).ReasonCode, byte(0x80), "a packet of exactly the limit is accepted")
		rc.sendBytes(t, sized(1025, 2))
		d, _ := rc.expectClosed(t, waitMsg)
		requireReason(t, e, d, 0x95)
	})
	t.Run("server_limit_enforced", func(t *testing.T) {
		t.Parallel()
		e := startEdge(t, "--mqtt.max-packet-size", "1024")
		topic := topicFor(t)
		sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
		sub.sub(t, topic, 1)

		rc, _ := connectRaw(t, e.TCP, rawConnect("big-"+uniq()))
		rc.send(t, &packets.Publish{Topic: topic, QoS: 1, PacketID: 1, Payload: []byte(strings.Repeat("a", 900)), Properties: &packets.Properties{}})
		require.Less(t, rc.expect(t, packets.PUBACK).Content.(*packets.Puback).ReasonCode, byte(0x80), "a packet within the limit is accepted")
		sub.expectPayloads(t, strings.Repeat("a", 900))

		rc.send(t, &packets.Publish{Topic: topic, QoS: 1, PacketID: 2, Payload: []byte(strings.Repeat("b", 2000)), Properties: &packets.Properties{}})
		// §3.2.2.3.6 and §4.13: a packet above the server's limit is a
		// Protocol Error; the server closes the connection, with DISCONNECT
		// 0x95 (Packet too large) if it sends one.
		d, _ := rc.expectClosed(t, waitMsg)
		requireReason(t, e, d, 0x95)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		pub.pub(t, topic, 1, "marker")
		sub.expectPayloads(t, "marker") // the oversize message was not routed
	})
}

// TestConformance_MaxInflight checks the edge's own bound on QoS 1
// messages in flight to one client (--mqtt.max-inflight): a client that
// allows 100 (Receive Maximum) and a 3.1.1 client, which announces none,
// get no more than the edge's 3 unacknowledged at once, in order, and the
// next one once an acknowledgement frees a place.
func TestConformance_MaxInflight(t *testing.T) {
	t.Parallel()
	skipIfExternal(t, "keel-edge's --mqtt.max-inflight")
	const window, total = 3, 8
	e := startEdge(t, "--mqtt.max-inflight", fmt.Sprint(window))
	for _, v5 := range []bool{true, false} {
		topic := topicFor(t)
		var rc *rawClient
		if v5 {
			cp := rawConnect("mi-" + uniq())
			cp.Properties.ReceiveMaximum = u16(100)
			rc, _ = connectRaw(t, e.TCP, cp)
			rc.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
				Subscriptions: []packets.SubOptions{{Topic: topic, QoS: 1}}})
			rc.expect(t, packets.SUBACK)
		} else {
			var code byte
			rc, code = connectV311Raw(t, e.TCP, v311Conn{clientID: "mi3-" + uniq(), keepAlive: 30})
			require.Equal(t, byte(0), code)
			rc.sendBytes(t, v311Subscribe(1, 1, topic))
			rc.v311Suback(t)
		}
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		want := payloads("m", total)
		for _, p := range want {
			pub.pub(t, topic, 1, p)
		}
		var unacked []uint16
		received := 0
		receive := func() {
			t.Helper()
			var payload string
			var id uint16
			if v5 {
				p, _ := rc.expectPublish(t)
				payload, id = string(p.Payload), p.PacketID
			} else {
				payload, id = rc.v311ExpectPublish(t)
			}
			require.Equal(t, want[received], payload, "v5 %v: in order", v5)
			unacked = append(unacked, id)
			received++
		}
		for range window {
			receive()
		}
		rc.expectSilence(t, 300*time.Millisecond)
		for received < total {
			if v5 {
				rc.send(t, &packets.Puback{PacketID: unacked[0], Properties: &packets.Properties{}})
			} else {
				rc.sendBytes(t, []byte{0x40, 0x02, byte(unacked[0] >> 8), byte(unacked[0])})
			}
			unacked = unacked[1:]
			receive()
			rc.expectSilence(t, 50*time.Millisecond)
		}
	}
}

// TestConformance_PublishRate checks the per-client publish rate
// (--mqtt.publish-rate, --mqtt.publish-burst): past its burst a client's
// publishes are read no faster than the rate, so the edge pushes back
// through TCP rather than refuse or drop; every message is delivered, in
// order.
func TestConformance_PublishRate(t *testing.T) {
	t.Parallel()
	skipIfExternal(t, "keel-edge's --mqtt.publish-rate")
	const rate, burst, n = 50, 10, 60
	e := startEdge(t, "--mqtt.publish-rate", fmt.Sprint(rate), "--mqtt.publish-burst", fmt.Sprint(burst))
	topic := topicFor(t)
	sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
	sub.sub(t, topic+"/#", 1)
	slow := connectV5(t, e.TCP, v5Connect("rated-"+uniq()))

	start := time.Now()
	for i := range n {
		slow.pub(t, topic+"/rated", 1, fmt.Sprint(i)) // every PUBACK < 0x80
	}
	took := time.Since(start)
	// (n - burst) publishes at the rate take at least (n-burst)/rate.
	min := time.Duration(n-burst) * time.Second / rate
	require.GreaterOrEqual(t, took, min*9/10, "publishes past the burst are held to the rate")
	got := 0
	for range n {
		m := sub.next(t)
		require.Equal(t, fmt.Sprint(got), string(m.Payload), "in order")
		got++
	}
	require.Equal(t, n, got, "nothing dropped")

}
