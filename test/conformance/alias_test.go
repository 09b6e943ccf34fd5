package conformance

import (
	"fmt"
	"math"
	"testing"

	"github.com/eclipse/paho.golang/packets"
	"github.com/stretchr/testify/require"
)

// TestConformance_TopicAlias checks topic aliases sent by a client: a mapped
// alias stands for its topic, can be remapped, is not carried over to a new
// connection, and out-of-range or unknown aliases end the connection.
func TestConformance_TopicAlias(t *testing.T) {
	t.Parallel()
	const aliasMax = 10
	var e *edge
	if suite.external != "" {
		e = startEdge(t)
	} else {
		e = startEdge(t, "--mqtt.topic-alias-maximum", fmt.Sprint(aliasMax))
	}
	announced := func(ca *packets.Connack) uint16 {
		if ca.Properties == nil || ca.Properties.TopicAliasMaximum == nil {
			return 0
		}
		return *ca.Properties.TopicAliasMaximum
	}
	// connect returns a raw client and the Topic Alias Maximum in force:
	// the announced one, or for keel-edge the configured one.
	connect := func(t *testing.T, cp *packets.Connect) (*rawClient, uint16) {
		t.Helper()
		rc, ca := connectRaw(t, e.TCP, cp)
		if max := announced(ca); max > 0 {
			return rc, max
		}
		if e.external {
			t.Skip("the server announces no Topic Alias Maximum: it accepts no aliases")
		}
		return rc, aliasMax
	}
	expectAnyError := []byte{0x81, 0x82, 0x94}
	publish := func(t *testing.T, rc *rawClient, topic string, alias, id uint16, payload string) {
		t.Helper()
		rc.send(t, &packets.Publish{Topic: topic, QoS: 1, PacketID: id, Payload: []byte(payload),
			Properties: &packets.Properties{TopicAlias: u16(alias)}})
	}
	// expectRefused requires the server to close the connection, with a
	// DISCONNECT carrying one of codes if it sends one ([MQTT-4.13.1-1]).
	expectRefused := func(t *testing.T, rc *rawClient, codes ...byte) {
		t.Helper()
		d, _ := rc.expectClosed(t, waitMsg)
		requireReason(t, e, d, codes...)
	}

	t.Run("maximum_announced", func(t *testing.T) {
		t.Parallel()
		if e.external {
			t.Skip("the configured maximum is known for keel-edge only")
		}
		_, ca := connectRaw(t, e.TCP, rawConnect("alias-"+uniq()))
		// [MQTT-3.2.2-17]: without a Topic Alias Maximum in CONNACK the client
		// must not send any alias, so a server that accepts aliases says so.
		require.Equal(t, uint16(aliasMax), announced(ca), "CONNACK Topic Alias Maximum")
	})
	t.Run("mapped_remapped_and_resolved", func(t *testing.T) {
		t.Parallel()
		base := topicFor(t)
		sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
		sub.sub(t, base+"/#", 1)
		rc, _ := connect(t, rawConnect("alias-"+uniq()))
		steps := []struct{ topic, payload string }{
			{base + "/a", "1"}, // maps alias 1 to base/a
			{"", "2"},          // alias only
			{base + "/b", "3"}, // remaps alias 1 to base/b
			{"", "4"},
		}
		for i, s := range steps {
			publish(t, rc, s.topic, 1, uint16(i+1), s.payload)
			ack := rc.expect(t, packets.PUBACK).Content.(*packets.Puback)
			require.Less(t, ack.ReasonCode, byte(0x80), "PUBACK for step %d", i)
		}
		// [MQTT-3.3.2-12]: the server accepts aliases up to its maximum and
		// resolves them; the subscriber sent no Topic Alias Maximum, so the
		// server sends it no alias ([MQTT-3.3.2-11]) but the full topic.
		for i, want := range []string{base + "/a", base + "/a", base + "/b", base + "/b"} {
			m := sub.next(t)
			require.Equal(t, steps[i].payload, string(m.Payload))
			require.Equal(t, want, m.Topic)
			require.Nil(t, m.Properties.TopicAlias)
		}
	})
	t.Run("alias_zero", func(t *testing.T) {
		t.Parallel()
		rc, _ := connect(t, rawConnect("alias-"+uniq()))
		publish(t, rc, topicFor(t), 0, 1, "x")
		expectRefused(t, rc, expectAnyError...) // [MQTT-3.3.2-8]: a Topic Alias of 0 is not permitted
	})
	t.Run("alias_above_maximum", func(t *testing.T) {
		t.Parallel()
		rc, max := connect(t, rawConnect("alias-"+uniq()))
		if max == math.MaxUint16 {
			t.Skip("Topic Alias Maximum is 65535: no alias is above it")
		}
		publish(t, rc, topicFor(t), max+1, 1, "x")
		expectRefused(t, rc, 0x94) // [MQTT-3.3.2-9] §3.3.2.3.4: Topic Alias invalid
	})
	t.Run("unknown_alias", func(t *testing.T) {
		t.Parallel()
		rc, _ := connect(t, rawConnect("alias-"+uniq()))
		publish(t, rc, "", 7, 1, "x") // never mapped: a Protocol Error (§3.3.2.3.4)
		expectRefused(t, rc, expectAnyError...)
	})
	t.Run("server_to_client", func(t *testing.T) {
		t.Parallel()
		if e.external {
			t.Skip("a server need not send aliases; keel-edge does")
		}
		// §3.3.2.3.4: a client that announces a Topic Alias Maximum may get
		// aliases from the server, never above that maximum
		// ([MQTT-3.3.2-10]); keel-edge maps a topic on its first delivery
		// and then sends the alias alone.
		base := topicFor(t)
		cp := rawConnect("alias-in-" + uniq())
		cp.Properties.TopicAliasMaximum = u16(2)
		rc, _ := connectRaw(t, e.TCP, cp)
		rc.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
			Subscriptions: []packets.SubOptions{{Topic: base + "/#", QoS: 0}}})
		rc.expect(t, packets.SUBACK)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		topics := []string{base + "/a", base + "/a", base + "/b", base + "/c", base + "/a", base + "/c"}
		for i, tp := range topics {
			pub.pub(t, tp, 0, fmt.Sprint(i))
		}
		names := map[uint16]string{} // the mapping as the client keeps it
		for i, want := range topics {
			p, _ := rc.expectPublish(t)
			require.Equal(t, fmt.Sprint(i), string(p.Payload))
			var alias uint16
			if p.Properties != nil && p.Properties.TopicAlias != nil {
				alias = *p.Properties.TopicAlias
				require.NotZero(t, alias, "[MQTT-3.3.2-8]")
				require.LessOrEqual(t, alias, uint16(2), "[MQTT-3.3.2-10]: not above the client's maximum")
			}
			got := p.Topic
			switch {
			case got != "" && alias > 0:
				names[alias] = got // (re)mapped
			case got == "":
				require.NotZero(t, alias, "a PUBLISH without a topic carries an alias")
				got = names[alias]
			}
			require.Equal(t, want, got, "message %d", i)
		}
		require.NotEmpty(t, names, "keel-edge used aliases")
	})
	t.Run("not_carried_across_connections", func(t *testing.T) {
		t.Parallel()
		cp := rawConnect("alias-" + uniq())
		cp.Properties.SessionExpiryInterval = u32(60)
		rc, _ := connect(t, cp)
		publish(t, rc, topicFor(t), 1, 1, "x")
		rc.expect(t, packets.PUBACK)
		require.NoError(t, rc.conn.Close())
		cp.CleanStart = false
		rc, _ = connect(t, cp)
		publish(t, rc, "", 1, 2, "y") // [MQTT-3.3.2-7]: the mapping died with the connection
		expectRefused(t, rc, expectAnyError...)
	})
}
