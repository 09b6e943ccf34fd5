package broker

import (
	"io"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// An MQTT 5 SUBSCRIBE whose subscription options or Subscription
// Identifier the spec forbids is not granted: the edge ends the connection
// with a DISCONNECT carrying the reason ([MQTT-4.13.1-1]), 0x81 for a
// Malformed Packet and 0x82 for a Protocol Error, and the subscription is
// not made.
func TestBroker_SubscribeForbiddenOptionsEndTheConnection(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, nil)
	// subscribe is an MQTT 5 SUBSCRIBE, packet ID 1, of the properties
	// props (without their length) and then the payload bytes.
	subscribe := func(props []byte, payload ...byte) []byte {
		body := append([]byte{0x00, 0x01, byte(len(props))}, props...)
		body = append(body, payload...)
		return append([]byte{0x82, byte(len(body))}, body...)
	}
	filter := []byte{0x00, 0x03, 's', '/', 'o'}
	withOptions := func(o byte) []byte { return append(append([]byte(nil), filter...), o) }
	for _, tc := range []struct {
		name string
		pkt  []byte
		code byte
	}{
		// The options byte of the last filter is missing: §3.8.3 gives
		// every Topic Filter one, so the packet cannot be parsed.
		{"options_byte_missing", subscribe(nil, filter...), packets.ErrMalformedPacket.Code},
		{"second_options_byte_missing", subscribe(nil, append(withOptions(0x01), filter...)...), packets.ErrMalformedPacket.Code},
		// [MQTT-3.8.3-5]: the Server MUST treat a SUBSCRIBE packet as
		// malformed if any of the reserved bits (6 and 7) are non-zero.
		{"reserved_bit_6", subscribe(nil, withOptions(0x41)...), packets.ErrMalformedPacket.Code},
		{"reserved_bit_7", subscribe(nil, withOptions(0x81)...), packets.ErrMalformedPacket.Code},
		// §3.8.3.1: it is a Protocol Error to send a Retain Handling
		// value of 3.
		{"retain_handling_3", subscribe(nil, withOptions(0x31)...), packets.ErrProtocolViolation.Code},
		// §3.8.3.1: it is a Protocol Error if the Maximum QoS field has
		// the value 3 (already refused; kept beside the others).
		{"maximum_qos_3", subscribe(nil, withOptions(0x03)...), packets.ErrProtocolViolation.Code},
		// §3.8.2.1.2: it is a Protocol Error if the Subscription
		// Identifier has a value of 0, or is included more than once.
		{"subscription_identifier_0", subscribe([]byte{0x0b, 0x00}, withOptions(0x01)...), packets.ErrProtocolViolation.Code},
		{"subscription_identifier_twice", subscribe([]byte{0x0b, 0x01, 0x0b, 0x02}, withOptions(0x01)...), packets.ErrProtocolViolation.Code},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := mqtttest.Dial(t, addr, 5)
			c.Connect("subopts-"+tc.name, true, packets.Properties{})
			_, err := c.Conn.Write(tc.pkt)
			require.NoError(t, err)
			pk, err := c.Read(5 * time.Second)
			require.NoError(t, err, "a DISCONNECT before the connection ends")
			require.Equal(t, packets.Disconnect, pk.FixedHeader.Type, "got packet type %d (reasons %v)", pk.FixedHeader.Type, pk.ReasonCodes)
			require.Equal(t, tc.code, pk.ReasonCode)
			_, err = c.Read(5 * time.Second)
			require.ErrorIs(t, err, io.EOF, "the connection ends")
		})
	}
	// The same options, allowed: Retain Handling 2, Retain As Published,
	// Subscription Identifier 1 (§3.8.3.1, §3.8.2.1.2).
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("subopts-allowed", true, packets.Properties{})
	_, err := c.Conn.Write(subscribe([]byte{0x0b, 0x01}, withOptions(0x29)...))
	require.NoError(t, err)
	require.Equal(t, []byte{0x01}, c.Expect(packets.Suback).ReasonCodes)
}
