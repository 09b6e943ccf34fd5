package conformance

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestConformance_QoSDelivery publishes ten messages at each QoS, over MQTT
// 5 and 3.1.1 and across the two, and checks that each arrives exactly once,
// in order, at the minimum of the published QoS and the granted QoS.
//
//   - [MQTT-3.8.4-8] delivered QoS is min(published QoS, granted QoS).
//   - [MQTT-4.3.1-1] [MQTT-4.3.2-1] [MQTT-4.3.3-1] QoS 0, 1 and 2 flows.
//   - [MQTT-4.6.0-6] a topic is an ordered topic: messages arrive in order.
//   - [MQTT-3.3.2-3] the topic name sent to a subscriber is the published one.
func TestConformance_QoSDelivery(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	cases := []struct {
		name                string
		pubQoS, subQoS, got byte
	}{
		{"qos0", 0, 2, 0},
		{"qos1", 1, 2, 1},
		{"qos2", 2, 2, 2},
		{"qos2_granted_qos1", 2, 1, 1},
		{"qos1_granted_qos0", 1, 0, 0},
	}
	for _, tc := range cases {
		t.Run("mqtt5_"+tc.name, func(t *testing.T) {
			t.Parallel()
			topic := topicFor(t)
			sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
			sub.sub(t, topic, tc.subQoS)
			pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
			want := append(payloads("m", 10), "end")
			for _, p := range want {
				pub.pub(t, topic, tc.pubQoS, p)
			}
			for _, m := range sub.expectPayloads(t, want...) {
				require.Equal(t, tc.got, m.QoS, "delivered QoS")
				require.Equal(t, topic, m.Topic)
				require.False(t, m.Retain)
			}
			sub.expectNothing(t, quiet) // exactly once: no duplicate after "end"
		})
		t.Run("mqtt311_"+tc.name, func(t *testing.T) {
			t.Parallel()
			topic := topicFor(t)
			sub := connectV3(t, v3Options("tcp://"+e.TCP, "sub-"+uniq()))
			sub.sub(t, topic, tc.subQoS)
			pub := connectV3(t, v3Options("tcp://"+e.TCP, "pub-"+uniq()))
			want := append(payloads("m", 10), "end")
			for _, p := range want {
				pub.pub(t, topic, tc.pubQoS, false, p)
			}
			for _, m := range sub.expectPayloads(t, want...) {
				require.Equal(t, tc.got, m.Qos(), "delivered QoS")
				require.Equal(t, topic, m.Topic())
				require.False(t, m.Retained())
			}
			sub.expectNothing(t, quiet)
		})
	}
	t.Run("mqtt311_to_mqtt5", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
		sub.sub(t, topic, 2)
		pub := connectV3(t, v3Options("tcp://"+e.TCP, "pub-"+uniq()))
		want := payloads("m", 5)
		for _, p := range want {
			pub.pub(t, topic, 2, false, p)
		}
		for _, m := range sub.expectPayloads(t, want...) {
			require.Equal(t, byte(2), m.QoS)
		}
	})
	t.Run("mqtt5_to_mqtt311", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		sub := connectV3(t, v3Options("tcp://"+e.TCP, "sub-"+uniq()))
		sub.sub(t, topic, 2)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		want := payloads("m", 5)
		for _, p := range want {
			pub.pub(t, topic, 1, p)
		}
		for _, m := range sub.expectPayloads(t, want...) {
			require.Equal(t, byte(1), m.Qos())
		}
	})
	t.Run("wildcards", func(t *testing.T) {
		t.Parallel()
		// [MQTT-4.7.1-1] '#' matches the parent and any number of levels;
		// [MQTT-4.7.1-2] '+' matches exactly one level.
		base := topicFor(t)
		multi := connectV5(t, e.TCP, v5Connect("multi-"+uniq()))
		multi.sub(t, base+"/#", 1)
		single := connectV5(t, e.TCP, v5Connect("single-"+uniq()))
		single.sub(t, base+"/+/x", 1)
		pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
		for _, topic := range []string{base, base + "/a/x", base + "/a/b/x", base + "/a/y"} {
			pub.pub(t, topic, 1, topic)
		}
		multi.expectPayloads(t, base, base+"/a/x", base+"/a/b/x", base+"/a/y")
		single.expectPayloads(t, base+"/a/x")
		pub.pub(t, base+"/z/x", 1, "end")
		single.expectPayloads(t, "end")
	})
}
