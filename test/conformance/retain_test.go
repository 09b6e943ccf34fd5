package conformance

import (
	"sort"
	"testing"

	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// TestConformance_Retained checks retained messages: storing, replacing and
// deleting them, delivery to new subscriptions with the RETAIN flag set, the
// three Retain Handling options and Retain As Published.
//
// Where a retained message must not arrive, the test publishes a
// non-retained "marker" on the same topic after the SUBACK: the retained
// message, if any, is queued at subscribe time, before the marker, so the
// first message received decides.
func TestConformance_Retained(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	retain := func(t *testing.T, c *v5Client, topic, payload string, qos byte) {
		t.Helper()
		c.publish(t, &paho.Publish{Topic: topic, QoS: qos, Retain: true, Payload: []byte(payload)})
	}
	subscribe := func(t *testing.T, c *v5Client, opts paho.SubscribeOptions) {
		t.Helper()
		c.subscribe(t, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{opts}})
	}
	clients := func(t *testing.T) (pub, sub *v5Client, topic string) {
		t.Helper()
		return connectV5(t, e.TCP, v5Connect("pub-"+uniq())), connectV5(t, e.TCP, v5Connect("sub-"+uniq())), topicFor(t)
	}

	t.Run("delivered_on_subscribe", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		retain(t, pub, topic, "r1", 1)
		sub.sub(t, topic, 1)
		pub.pub(t, topic, 1, "marker")
		got := sub.expectPayloads(t, "r1", "marker") // [MQTT-3.3.1-5] [MQTT-3.3.1-9]: exactly once
		require.True(t, got[0].Retain, "a retained message sent for a new subscription has RETAIN 1 (§3.3.1.3)")
		require.False(t, got[1].Retain)
		sub.expectNothing(t, quiet)
	})
	t.Run("replaced", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		retain(t, pub, topic, "old", 1)
		retain(t, pub, topic, "new", 1) // [MQTT-3.3.1-5]: replaces the retained message
		sub.sub(t, topic, 1)
		pub.pub(t, topic, 1, "marker")
		sub.expectPayloads(t, "new", "marker")
	})
	t.Run("deleted_by_empty_payload", func(t *testing.T) {
		t.Parallel()
		pub, live, topic := clients(t)
		live.sub(t, topic, 1)
		retain(t, pub, topic, "r1", 1)
		retain(t, pub, topic, "", 1)
		// [MQTT-3.3.1-6]: a zero-byte retained message is delivered as normal...
		got := live.expectPayloads(t, "r1", "")
		require.Empty(t, got[1].Payload)
		// ...removes the retained message, and is not stored itself [MQTT-3.3.1-7].
		late := connectV5(t, e.TCP, v5Connect("late-"+uniq()))
		late.sub(t, topic, 1)
		pub.pub(t, topic, 1, "marker")
		late.expectPayloads(t, "marker")
	})
	t.Run("not_replaced_by_non_retained", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		retain(t, pub, topic, "kept", 1)
		pub.pub(t, topic, 1, "plain") // [MQTT-3.3.1-8]: RETAIN 0 neither stores nor replaces
		sub.sub(t, topic, 1)
		pub.pub(t, topic, 1, "marker")
		sub.expectPayloads(t, "kept", "marker")
	})
	t.Run("live_delivery_clears_retain_flag", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		sub.sub(t, topic, 1)
		retain(t, pub, topic, "live", 1)
		m := sub.expectPayloads(t, "live")[0]
		require.False(t, m.Retain, "[MQTT-3.3.1-12] Retain As Published 0: RETAIN 0 on forwarded messages")
	})
	t.Run("retain_as_published", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		subscribe(t, sub, paho.SubscribeOptions{Topic: topic, QoS: 1, RetainAsPublished: true})
		retain(t, pub, topic, "retained", 1)
		pub.pub(t, topic, 1, "plain")
		got := sub.expectPayloads(t, "retained", "plain")
		require.True(t, got[0].Retain, "[MQTT-3.3.1-13] RETAIN as published")
		require.False(t, got[1].Retain, "[MQTT-3.3.1-13] RETAIN as published")
	})
	t.Run("retain_handling_0", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		retain(t, pub, topic, "r", 1)
		opts := paho.SubscribeOptions{Topic: topic, QoS: 1, RetainHandling: 0}
		subscribe(t, sub, opts)
		sub.expectPayloads(t, "r") // [MQTT-3.3.1-9]
		subscribe(t, sub, opts)    // the same filter again: sent again
		sub.expectPayloads(t, "r")
		pub.pub(t, topic, 1, "marker")
		sub.expectPayloads(t, "marker")
	})
	t.Run("retain_handling_1", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		retain(t, pub, topic, "r", 1)
		opts := paho.SubscribeOptions{Topic: topic, QoS: 1, RetainHandling: 1}
		subscribe(t, sub, opts)
		sub.expectPayloads(t, "r") // a new subscription: sent
		subscribe(t, sub, opts)    // [MQTT-3.3.1-10]: it already existed: not sent
		pub.pub(t, topic, 1, "marker")
		sub.expectPayloads(t, "marker")
	})
	t.Run("retain_handling_2", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		retain(t, pub, topic, "r", 1)
		subscribe(t, sub, paho.SubscribeOptions{Topic: topic, QoS: 1, RetainHandling: 2})
		pub.pub(t, topic, 1, "marker") // [MQTT-3.3.1-11]: never sent at subscribe
		sub.expectPayloads(t, "marker")
	})
	t.Run("wildcard_subscription", func(t *testing.T) {
		t.Parallel()
		pub, sub, base := clients(t)
		retain(t, pub, base+"/a", "a", 1)
		retain(t, pub, base+"/b", "b", 0)
		retain(t, pub, base+"/c/d", "c/d", 1)
		sub.sub(t, base+"/+", 1) // [MQTT-3.8.4-4]: every matching retained message
		got := []string{string(sub.next(t).Payload), string(sub.next(t).Payload)}
		sort.Strings(got)
		require.Equal(t, []string{"a", "b"}, got)
		pub.pub(t, base+"/z", 1, "marker")
		sub.expectPayloads(t, "marker")
	})
	t.Run("qos_is_minimum", func(t *testing.T) {
		t.Parallel()
		pub, sub, topic := clients(t)
		retain(t, pub, topic, "r", 1)
		sub.sub(t, topic, 0)
		require.Equal(t, byte(0), sub.expectPayloads(t, "r")[0].QoS, "[MQTT-3.8.4-8] min(message QoS, granted QoS)")
		sub2 := connectV5(t, e.TCP, v5Connect("sub2-"+uniq()))
		sub2.sub(t, topic, 2)
		require.Equal(t, byte(1), sub2.expectPayloads(t, "r")[0].QoS, "[MQTT-3.8.4-8] min(message QoS, granted QoS)")
	})
	t.Run("mqtt311", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		pub := connectV3(t, v3Options("tcp://"+e.TCP, "pub-"+uniq()))
		live := connectV3(t, v3Options("tcp://"+e.TCP, "live-"+uniq()))
		live.sub(t, topic, 1)
		pub.pub(t, topic, 1, true, "r311")
		require.False(t, live.expectPayloads(t, "r311")[0].Retained(), "3.1.1 [MQTT-3.3.1-9]: RETAIN 0 when sent to an established subscription")
		late := connectV3(t, v3Options("tcp://"+e.TCP, "late-"+uniq()))
		late.sub(t, topic, 1)
		require.True(t, late.expectPayloads(t, "r311")[0].Retained(), "3.1.1 [MQTT-3.3.1-8]: RETAIN 1 when sent for a new subscription")
	})
}
