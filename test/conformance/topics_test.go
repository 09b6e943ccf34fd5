package conformance

import (
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// TestConformance_SharedSubscriptions checks $share/<group>/<filter> and the
// $queue/<filter> form: each message goes to exactly one member of a group,
// every member gets some, groups and ordinary subscriptions each get every
// message, a member that leaves stops receiving, and no retained message is
// sent for a shared subscription.
func TestConformance_SharedSubscriptions(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	const total = 40
	// collect reads messages from each member until total have arrived
	// together, and returns the payloads per member.
	collect := func(t *testing.T, members ...*v5Client) [][]string {
		t.Helper()
		got := make([][]string, len(members))
		deadline := time.After(waitMsg)
		for n := 0; n < total; n++ {
			select {
			case m := <-members[0].msgs:
				got[0] = append(got[0], string(m.Payload))
			case m := <-members[1].msgs:
				got[1] = append(got[1], string(m.Payload))
			case <-deadline:
				t.Fatalf("only %d of %d messages reached the group: %v", n, total, got)
			}
		}
		for _, m := range members {
			m.expectNothing(t, quiet) // exactly one member per message
		}
		return got
	}
	checkSplit := func(t *testing.T, got [][]string, want []string) {
		t.Helper()
		require.ElementsMatch(t, want, append(append([]string{}, got[0]...), got[1]...), "each message to exactly one member (§4.8.2)")
		require.NotEmpty(t, got[0], "member 1 got no message")
		require.NotEmpty(t, got[1], "member 2 got no message")
	}
	member := func(t *testing.T, filter string) *v5Client {
		t.Helper()
		c := connectV5(t, e.TCP, v5Connect("m-"+uniq()))
		c.sub(t, filter, 1)
		return c
	}

	for _, form := range []string{"share", "queue"} {
		t.Run(form, func(t *testing.T) {
			t.Parallel()
			topic := topicFor(t)
			filter := "$share/g/" + topic
			if form == "queue" {
				if e.external {
					t.Skip("$queue/ is a keel-edge extension")
				}
				filter = "$queue/" + topic
			}
			m1, m2 := member(t, filter), member(t, filter)
			plain := member(t, topic)
			pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
			want := payloads("m", total)
			for _, p := range want {
				pub.pub(t, topic, 1, p)
			}
			checkSplit(t, collect(t, m1, m2), want)
			plain.expectPayloads(t, want...)
		})
	}
	t.Run("groups_are_independent", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		g1a, g1b := member(t, "$share/g1/"+topic), member(t, "$share/g1/"+topic)
		g2 := member(t, "$share/g2/"+topic)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		want := payloads("m", total)
		for _, p := range want {
			pub.pub(t, topic, 1, p)
		}
		checkSplit(t, collect(t, g1a, g1b), want)
		g2.expectPayloads(t, want...) // a one-member group gets everything
	})
	t.Run("wildcard_filter_and_mqtt311_member", func(t *testing.T) {
		t.Parallel()
		base := topicFor(t)
		m1 := member(t, "$share/g/"+base+"/+")
		m2 := connectV3(t, v3Options("tcp://"+e.TCP, "m311-"+uniq()))
		m2.sub(t, "$share/g/"+base+"/+", 1)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		want := payloads("m", total)
		for i, p := range want {
			pub.pub(t, base+"/"+[]string{"a", "b"}[i%2], 1, p)
		}
		var got1, got2 []string
		for n := 0; n < total; n++ {
			select {
			case m := <-m1.msgs:
				got1 = append(got1, string(m.Payload))
			case m := <-m2.msgs:
				got2 = append(got2, string(m.Payload()))
			case <-time.After(waitMsg):
				t.Fatalf("only %d of %d messages reached the group", n, total)
			}
		}
		checkSplit(t, [][]string{got1, got2}, want)
	})
	t.Run("member_leaves", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		m1, m2 := member(t, "$share/g/"+topic), member(t, "$share/g/"+topic)
		require.NoError(t, m2.Disconnect(&paho.Disconnect{}))
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		want := payloads("m", 10)
		for _, p := range want {
			pub.pub(t, topic, 1, p)
		}
		m1.expectPayloads(t, want...) // the remaining member gets all
	})
	t.Run("no_retained_messages", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		pub.publish(t, &paho.Publish{Topic: topic, QoS: 1, Retain: true, Payload: []byte("retained")})
		m := member(t, "$share/g/"+topic)
		pub.pub(t, topic, 1, "marker")
		// §4.8.2: retained messages are not sent to a shared subscription.
		m.expectPayloads(t, "marker")
	})
}

// TestConformance_InvalidTopicFilter subscribes to malformed filters, each
// alongside a valid one, and checks that SUBACK refuses exactly the invalid
// filter with 0x8F (MQTT 5) or 0x80 (MQTT 3.1.1) and grants the other.
func TestConformance_InvalidTopicFilter(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	invalid := []struct{ name, filter string }{
		{"hash_not_last", "a/#/b"},         // [MQTT-4.7.1-1]
		{"hash_not_whole_level", "a/b#"},   // [MQTT-4.7.1-1]
		{"plus_not_whole_level", "a/b+/c"}, // [MQTT-4.7.1-2]
		{"empty", ""},                      // [MQTT-4.7.3-1]
		{"share_without_filter", "$share/g"},
		{"share_empty_group", "$share//a"},      // [MQTT-4.8.2-1]
		{"share_wildcard_group", "$share/g+/a"}, // [MQTT-4.8.2-2]
	}
	for _, tc := range invalid {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			valid := topicFor(t)
			rc, _ := connectRaw(t, e.TCP, rawConnect("if-"+uniq()))
			rc.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
				Subscriptions: []packets.SubOptions{{Topic: valid, QoS: 1}, {Topic: tc.filter, QoS: 1}}})
			cp, _, err := rc.read(waitMsg)
			require.NoError(t, err)
			if e.external && cp.Type == packets.DISCONNECT {
				// The spec also lets a server treat a malformed filter as a
				// Malformed Packet or Protocol Error and end the connection
				// (§4.13); keel-edge answers per filter instead.
				require.Contains(t, []byte{0x81, 0x82}, cp.Content.(*packets.Disconnect).ReasonCode)
				t.Skipf("the external broker ends the connection instead: %s", cp)
			}
			require.Equal(t, packets.SUBACK, cp.Type, "got %s", cp)
			// [MQTT-3.9.3-1] one reason code per filter, in order; §3.9.3:
			// 0x8F Topic Filter invalid.
			require.Equal(t, []byte{0x01, 0x8f}, cp.Content.(*packets.Suback).Reasons, "SUBACK reason codes")
			rc.expectOpen(t)

			old, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "if3-" + uniq(), keepAlive: 30})
			require.Equal(t, byte(0), code)
			old.sendBytes(t, v311Subscribe(1, 1, valid, tc.filter))
			require.Equal(t, []byte{0x01, 0x80}, old.v311Suback(t), "3.1.1 SUBACK return codes")
		})
	}
}

// TestConformance_InvalidTopicName publishes to topic names with wildcards
// and checks that the server ends an MQTT 5 connection with DISCONNECT 0x90
// and an MQTT 3.1.1 one by closing it, and routes nothing.
func TestConformance_InvalidTopicName(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	for _, tc := range []struct{ name, topic string }{
		{"plus", "a/+/b"},
		{"hash", "a/#"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			watch := connectV5(t, e.TCP, v5Connect("w-"+uniq()))
			watch.sub(t, "a/#", 1)

			rc, _ := connectRaw(t, e.TCP, rawConnect("itn-"+uniq()))
			rc.send(t, &packets.Publish{Topic: tc.topic, QoS: 1, PacketID: 1, Payload: []byte("x"), Properties: &packets.Properties{}})
			// [MQTT-3.3.2-2]: no wildcards in a topic name; §3.3.2.1 and
			// [MQTT-4.13.1-1]: DISCONNECT 0x90 Topic Name invalid, then close.
			// An external broker may also treat it as a Malformed Packet or
			// Protocol Error (§4.13).
			d, _ := rc.expectClosed(t, waitMsg)
			require.NotNil(t, d, "no DISCONNECT before the close")
			if e.external {
				require.Contains(t, []byte{0x81, 0x82, 0x90}, d.ReasonCode, "DISCONNECT reason code")
			} else {
				require.Equal(t, byte(0x90), d.ReasonCode, "DISCONNECT reason code")
			}

			old, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "itn3-" + uniq(), keepAlive: 30})
			require.Equal(t, byte(0), code)
			old.sendBytes(t, v311Publish(tc.topic, 1, 1, "y"))
			old.expectClosed(t, waitMsg) // 3.1.1 [MQTT-3.3.2-2] [MQTT-4.8.0-1]

			watch.expectNothing(t, quiet)
		})
	}
}

// TestConformance_DollarTopics checks that filters starting with a wildcard
// do not match topic names starting with '$': neither the server's own $SYS
// topics (keel-edge publishes them every 200 ms here, retained) nor another
// '$' topic, live or retained.
func TestConformance_DollarTopics(t *testing.T) {
	t.Parallel()
	var e *edge
	if suite.external != "" {
		e = startEdge(t)
	} else {
		e = startEdge(t, "--mqtt.sys-interval", "200ms")
	}
	sys := connectV5(t, e.TCP, v5Connect("sys-"+uniq()))
	sys.sub(t, "$SYS/#", 0)
	sawSys := false
	select {
	case m := <-sys.msgs:
		sawSys = true
		t.Logf("the server publishes $SYS topics, e.g. %q", m.Topic)
	case <-time.After(waitMsg):
		if !e.external {
			t.Fatal("keel-edge published no $SYS message with --mqtt.sys-interval 200ms")
		}
		t.Log("no $SYS message seen; only the other '$' topic is checked")
	}

	topic := "$conformance-" + uniq() + "/x"
	pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
	pub.publish(t, &paho.Publish{Topic: topic, QoS: 1, Retain: true, Payload: []byte("retained")})
	hash := connectV5(t, e.TCP, v5Connect("hash-"+uniq()))
	hash.sub(t, "#", 0)
	plus := connectV5(t, e.TCP, v5Connect("plus-"+uniq()))
	plus.sub(t, "+/x", 0)
	plusHash := connectV5(t, e.TCP, v5Connect("plushash-"+uniq()))
	plusHash.sub(t, "+/#", 0)
	dollar := connectV5(t, e.TCP, v5Connect("dollar-"+uniq()))
	dollar.sub(t, topic, 1)
	dollar.expectPayloads(t, "retained") // an explicit filter matches
	pub.pub(t, topic, 1, "live")
	dollar.expectPayloads(t, "live")
	if sawSys && !e.external { // wait for a $SYS round published after the subscriptions
		for len(sys.msgs) > 0 {
			<-sys.msgs
		}
		sys.next(t)
	}
	// [MQTT-4.7.2-1]: no filter starting with a wildcard matches a '$'
	// topic. On a shared broker "#" also sees other tests' traffic, so
	// only '$' topics count.
	deadline := time.After(quiet)
	for done := false; !done; {
		select {
		case m := <-hash.msgs:
			require.NotEqual(t, byte('$'), m.Topic[0], "'#' matched %q", m.Topic)
		case m := <-plus.msgs:
			require.NotEqual(t, byte('$'), m.Topic[0], "'+/x' matched %q", m.Topic)
		case m := <-plusHash.msgs:
			require.NotEqual(t, byte('$'), m.Topic[0], "'+/#' matched %q", m.Topic)
		case <-deadline:
			done = true
		}
	}
}

// TestConformance_Takeover connects a second client with the same client ID
// and checks that the first gets DISCONNECT 0x8E and is closed, while the
// second carries on with the session.
func TestConformance_Takeover(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	t.Run("mqtt5", func(t *testing.T) {
		t.Parallel()
		topic, id := topicFor(t), "to-"+uniq()
		cp := v5Connect(id)
		cp.Properties.SessionExpiryInterval = u32(60)
		first := connectV5(t, e.TCP, cp)
		first.sub(t, topic, 1)
		cp = v5Connect(id)
		cp.CleanStart = false
		cp.Properties.SessionExpiryInterval = u32(60)
		second := connectV5(t, e.TCP, cp)
		// [MQTT-3.1.4-3]: DISCONNECT 0x8E Session taken over to the existing
		// client, whose connection is then closed.
		require.Equal(t, byte(0x8e), first.expectDisconnect(t).ReasonCode)
		select {
		case <-first.Done():
		case <-time.After(waitMsg):
			t.Fatal("the first connection stayed open")
		}
		require.True(t, second.Connack.SessionPresent, "the session continues")
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		pub.pub(t, topic, 1, "after")
		second.expectPayloads(t, "after") // the subscription moved with the session
	})
	t.Run("mqtt311", func(t *testing.T) {
		t.Parallel()
		id := "to3-" + uniq()
		first, code := connectV311Raw(t, e.TCP, v311Conn{clientID: id, keepAlive: 30})
		require.Equal(t, byte(0), code)
		second, code := connectV311Raw(t, e.TCP, v311Conn{clientID: id, keepAlive: 30})
		require.Equal(t, byte(0), code)
		first.expectClosed(t, waitMsg) // 3.1.1 [MQTT-3.1.4-2]
		second.expectOpen(t)
	})
}

// TestConformance_MalformedPacket sends packets the server cannot decode and
// checks that it ends an MQTT 5 connection with DISCONNECT 0x81 (Malformed
// Packet) and an MQTT 3.1.1 one by closing it ([MQTT-4.13.1-1], 3.1.1
// [MQTT-4.8.0-1]), that nothing of them is routed, and that the other
// clients carry on.
func TestConformance_MalformedPacket(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	for _, tc := range []struct {
		name string
		pkt  []byte
	}{
		// PUBLISH QoS 1 whose topic length (0x0010) runs past the packet.
		{"topic_length_past_the_end", []byte{0x32, 0x06, 0x00, 0x10, 'a', '/', 'b', 0x01}},
		// PUBLISH whose topic is not UTF-8 (0xC3 0x28) [MQTT-1.5.4-1].
		{"topic_not_utf8", []byte{0x30, 0x05, 0x00, 0x02, 0xc3, 0x28, 'x'}},
		// SUBSCRIBE with reserved flags 0000 instead of 0010 [MQTT-3.8.1-1].
		{"subscribe_reserved_flags", []byte{0x80, 0x07, 0x00, 0x01, 0x00, 0x01, 'a', 0x00, 0x00}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Not in parallel: the watcher sees every topic ("#"), so that
			// nothing of a malformed packet can go unseen.
			watch := connectV5(t, e.TCP, v5Connect("w-"+uniq()))
			watch.sub(t, "#", 1)

			rc, _ := connectRaw(t, e.TCP, rawConnect("mal-"+uniq()))
			pkt := append([]byte(nil), tc.pkt...)
			if pkt[0]>>4 == packets.PUBLISH || pkt[0]>>4 == packets.SUBSCRIBE {
				// MQTT 5 adds a property length after the variable header's
				// fixed part; a zero-length one keeps the fault the same.
				pkt = v5Malformed(pkt)
			}
			rc.sendBytes(t, pkt)
			d, _ := rc.expectClosed(t, waitMsg)
			if e.external {
				requireReason(t, e, d, 0x81, 0x82)
			} else {
				requireReason(t, e, d, 0x81)
			}

			old, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "mal3-" + uniq(), keepAlive: 30})
			require.Equal(t, byte(0), code)
			old.sendBytes(t, tc.pkt)
			old.expectClosed(t, waitMsg)

			watch.expectNothing(t, quiet)
			pub := connectV5(t, e.TCP, v5Connect("p-"+uniq()))
			pub.pub(t, "after/"+tc.name, 1, "still served")
			watch.expectPayloads(t, "still served")
		})
	}
}

// v5Malformed inserts a zero property length where MQTT 5 has one in a
// PUBLISH (after the topic and, at QoS > 0, the packet identifier) or a
// SUBSCRIBE (after the packet identifier), so that the packet keeps the
// 3.1.1 fault it was written with. A PUBLISH whose topic length runs past
// the end has no place for it and is left as it is.
func v5Malformed(pkt []byte) []byte {
	body := pkt[2:]
	var at int
	switch pkt[0] >> 4 {
	case packets.PUBLISH:
		n := int(body[0])<<8 | int(body[1])
		at = 2 + n
		if pkt[0]&0x06 != 0 {
			at += 2
		}
		if at > len(body) {
			return pkt
		}
	case packets.SUBSCRIBE:
		at = 2
	}
	out := append([]byte{pkt[0], pkt[1] + 1}, body[:at]...)
	out = append(out, 0x00)
	return append(out, body[at:]...)
}

// TestConformance_TopicLimits checks the edge's limits on topic names and
// filters (--mqtt.max-topic-length, --mqtt.max-topic-levels): a PUBLISH to
// a longer or deeper topic ends an MQTT 5 connection with DISCONNECT 0x90
// and a 3.1.1 one by closing it, a SUBSCRIBE to such a filter gets 0x8F
// (3.1.1: 0x80) for that filter alone, and topics at the limits work.
func TestConformance_TopicLimits(t *testing.T) {
	t.Parallel()
	skipIfExternal(t, "keel-edge's topic limits")
	e := startEdge(t, "--mqtt.max-topic-length", "24", "--mqtt.max-topic-levels", "4")
	base := "lim/" + uniq() // 13 bytes, two levels
	atLength := base + "/" + strings.Repeat("x", 24-len(base)-1)
	atLevels := base + "/c/d"
	for _, tc := range []struct{ name, topic string }{
		{"too_long", atLength + "y"},
		{"too_deep", atLevels + "/e"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			watch := connectV5(t, e.TCP, v5Connect("w-"+uniq()))
			watch.sub(t, base+"/#", 1)

			rc, _ := connectRaw(t, e.TCP, rawConnect("lim-"+uniq()))
			rc.send(t, &packets.Publish{Topic: tc.topic, QoS: 1, PacketID: 1, Payload: []byte("x"), Properties: &packets.Properties{}})
			d, _ := rc.expectClosed(t, waitMsg)
			requireReason(t, e, d, 0x90)

			old, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "lim3-" + uniq(), keepAlive: 30})
			require.Equal(t, byte(0), code)
			old.sendBytes(t, v311Publish(tc.topic, 1, 1, "y"))
			old.expectClosed(t, waitMsg)

			sub, _ := connectRaw(t, e.TCP, rawConnect("lims-"+uniq()))
			sub.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
				Subscriptions: []packets.SubOptions{{Topic: tc.topic, QoS: 1}, {Topic: base + "/ok", QoS: 1}}})
			ack := sub.expect(t, packets.SUBACK).Content.(*packets.Suback)
			require.Equal(t, []byte{0x8f, 0x01}, ack.Reasons, "the filter over the limit alone is refused")

			old, _ = connectV311Raw(t, e.TCP, v311Conn{clientID: "lims3-" + uniq(), keepAlive: 30})
			old.sendBytes(t, v311Subscribe(1, 1, tc.topic, base+"/ok"))
			require.Equal(t, []byte{0x80, 0x01}, old.v311Suback(t))

			watch.expectNothing(t, quiet)
		})
	}
	t.Run("at_the_limits", func(t *testing.T) {
		c := connectV5(t, e.TCP, v5Connect("at-"+uniq()))
		c.sub(t, atLength, 1)
		c.sub(t, atLevels, 1)
		c.pub(t, atLength, 1, "at length")
		c.pub(t, atLevels, 1, "at levels")
		c.expectPayloads(t, "at length", "at levels")
	})
}
