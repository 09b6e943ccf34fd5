package broker

import (
	"net"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// connackOf sends pkt on a new connection and returns the first bytes the
// edge answers with (at most 64), reading for up to 3 s.
func connackOf(t *testing.T, addr string, pkt []byte) []byte {
	t.Helper()
	c := sendOnNewConn(t, addr, pkt)
	defer c.Close()
	buf := make([]byte, 64)
	n, _ := c.Read(buf)
	return buf[:n]
}

// CONNECTs the specifications allow are accepted (CONNACK 0x00).
func TestBroker_ConnectAllowedByTheSpec(t *testing.T) {
	_, addr := startBroker(t, nil)
	const (
		clean    = 0x02
		password = 0x40
		username = 0x80
	)
	for _, tc := range []struct {
		name string
		pkt  []byte
	}{
		// MQTT 5 §3.1.2.9: a password without a user name is allowed.
		{"v5 password without user name", connectBytes("MQTT", 5, clean|password, nil, "c5pw", "secret")},
		// MQTT 3.1: user name and password.
		{"3.1 user name and password", connectBytes("MQIsdp", 3, clean|username|password, nil, "c31", "u", "p")},
		// The password is Binary Data of 0 to 65,535 bytes (3.1.1 §3.1.3.5,
		// MQTT 5 §3.1.3.6, §1.5.6): the flag set and a zero-length
		// password present satisfy [MQTT-3.1.2-21] / [MQTT-3.1.2-19].
		{"3.1.1 empty password", connectBytes("MQTT", 4, clean|username|password, nil, "c311e", "u", "")},
		{"v5 empty password", connectBytes("MQTT", 5, clean|username|password, nil, "c5e", "u", "")},
		{"v5 empty password, no user name", connectBytes("MQTT", 5, clean|password, nil, "c5e2", "")},
		// MQTT 3.1 (§3.1, Connect flags): Will QoS and Will Retain are
		// disregarded when the Will flag is not set, and bit 0 is unused;
		// only 3.1.1 made them faults ([MQTT-3.1.2-3], [MQTT-3.1.2-13],
		// [MQTT-3.1.2-15]). Mosquitto ignores them for 3.1 as well.
		{"3.1 will QoS without will flag", connectBytes("MQIsdp", 3, clean|1<<3, nil, "c31q")},
		{"3.1 will retain without will flag", connectBytes("MQIsdp", 3, clean|0x20, nil, "c31r")},
		{"3.1 reserved flag", connectBytes("MQIsdp", 3, clean|0x01, nil, "c31z")},
		// MQTT 3.1 (§3.1, Payload): the Remaining Length takes precedence
		// over the User Name and Password flags; a flag set without its
		// string is valid, and the connection goes on.
		{"3.1 user name flag without user name", connectBytes("MQIsdp", 3, clean|username, nil, "c31u")},
		{"3.1 password flag without password", connectBytes("MQIsdp", 3, clean|username|password, nil, "c31p", "u")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := connackOf(t, addr, tc.pkt)
			require.GreaterOrEqual(t, len(got), 4, "CONNACK; got % x", got)
			require.Equal(t, byte(0x20), got[0], "% x", got)
			require.Equal(t, byte(0x00), got[3], "CONNACK code; got % x", got)
		})
	}
}

// A CONNECT refused before mochi parsed it still honours the Maximum
// Packet Size the MQTT 5 client declared ([MQTT-3.1.2-24]): a CONNACK that
// would exceed it goes without its Reason String (§3.2.2.3.9).
func TestBroker_ConnectRefusalHonoursMaximumPacketSize(t *testing.T) {
	_, addr := startBroker(t, nil)
	props := []byte{0x27, 0, 0, 0, 8}                                         // Maximum Packet Size 8
	got := connackOf(t, addr, connectBytes("MQTT", 5, 0x02|0x01, props, "c")) // reserved flag: refused by vetConnect
	require.GreaterOrEqual(t, len(got), 4, "CONNACK; got % x", got)
	require.Equal(t, byte(0x81), got[3], "% x", got)
	require.LessOrEqual(t, len(got), 8, "CONNACK larger than the client's Maximum Packet Size: % x", got)
}

// A v5 SUBSCRIBE with several filters and one Subscription Identifier is
// granted for every filter (§3.8.2.1.2).
func TestBroker_SubscribeSeveralFiltersWithIdentifier(t *testing.T) {
	_, addr := startBroker(t, nil)
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("subid-several", true, packets.Properties{})
	c.Send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 7,
		Properties: packets.Properties{SubscriptionIdentifier: []int{42}},
		Filters:    packets.Subscriptions{{Filter: "a/#", Qos: 1}, {Filter: "b/+", Qos: 2}, {Filter: "c", Qos: 0}},
	})
	require.Equal(t, []byte{1, 2, 0}, c.Expect(packets.Suback).ReasonCodes)
	c.Publish(0, "b/x", 0, []byte("hi"))
	pk := c.Expect(packets.Publish)
	require.Equal(t, []int{42}, pk.Properties.SubscriptionIdentifier)
}

// An empty will message is published, with its empty payload, when the
// client goes away without DISCONNECT.
func TestBroker_EmptyWillIsPublished(t *testing.T) {
	_, addr := startBroker(t, nil)
	w := mqtttest.Dial(t, addr, 5)
	w.Connect("watch-empty-will", true, packets.Properties{})
	require.Equal(t, []byte{1}, w.Subscribe(1, "will/empty", 1).ReasonCodes)
	c, err := net.DialTimeout("tcp", addr, time.Second)
	require.NoError(t, err)
	_, err = c.Write(v5WillConnectBytes("empty-will", "will/empty", ""))
	require.NoError(t, err)
	buf := make([]byte, 64)
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	n, _ := c.Read(buf)
	require.GreaterOrEqual(t, n, 4)
	require.Equal(t, byte(0), buf[3])
	_ = c.Close()
	pk := w.Expect(packets.Publish)
	require.Equal(t, "will/empty", pk.TopicName)
	require.Empty(t, pk.Payload)
}
