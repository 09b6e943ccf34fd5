package broker

import (
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// connectBytes encodes a CONNECT: protocol name and level, connect flags,
// a 60 s keep alive, for level 5 the property bytes (props, a zero length
// when nil), then the payload fields as given, each written as a two-byte
// length and its bytes.
func connectBytes(name string, level, flags byte, props []byte, fields ...string) []byte {
	str := func(b []byte, s string) []byte {
		return append(binary.BigEndian.AppendUint16(b, uint16(len(s))), s...)
	}
	body := str(nil, name)
	body = append(body, level, flags, 0, 60)
	if level == 5 {
		body = append(append(body, byte(len(props))), props...)
	}
	for _, f := range fields {
		body = str(body, f)
	}
	return append([]byte{0x10, byte(len(body))}, body...)
}

// v5WillConnectBytes encodes an MQTT 5 CONNECT with clean start and a will
// (no properties).
func v5WillConnectBytes(clientID, topic, payload string) []byte {
	str := func(b []byte, s string) []byte {
		return append(binary.BigEndian.AppendUint16(b, uint16(len(s))), s...)
	}
	body := str(nil, "MQTT")
	body = append(body, 5, 0x02|0x04, 0, 60, 0)
	body = str(body, clientID)
	body = append(body, 0) // will properties
	body = str(str(body, topic), payload)
	return append([]byte{0x10, byte(len(body))}, body...)
}

// A will message may be empty: a zero-length will payload is a valid
// Binary Data field (3.1.1 §3.1.3.4; MQTT 5 §3.1.3.4), and the will of a
// client that goes away without DISCONNECT is published with it.
func TestBroker_ConnectEmptyWillPayload(t *testing.T) {
	_, addr := startBroker(t, nil)
	for _, level := range []byte{4, 5} {
		got := func() []byte {
			c, err := net.DialTimeout("tcp", addr, time.Second)
			require.NoError(t, err)
			defer c.Close()
			pkt := connectBytes("MQTT", 4, 0x02|0x04, nil, "will-empty", "will/empty", "")
			if level == 5 {
				pkt = v5WillConnectBytes("will-empty", "will/empty", "")
			}
			_, err = c.Write(pkt)
			require.NoError(t, err)
			_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
			buf := make([]byte, 64)
			n, _ := io.ReadAtLeast(c, buf, 4)
			return buf[:n]
		}()
		require.GreaterOrEqual(t, len(got), 4, "level %d: CONNACK; got % x", level, got)
		require.Equal(t, byte(0x20), got[0], "level %d: % x", level, got)
		require.Equal(t, byte(0), got[3], "level %d: CONNACK code; got % x", level, got)
	}
}
