package broker

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
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

// connectReply sends a CONNECT and returns what the edge wrote before it
// closed the connection; it fails if the connection stays open.
func connectReply(t *testing.T, addr string, pkt []byte) []byte {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write(pkt)
	require.NoError(t, err)
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	var got []byte
	buf := make([]byte, 256)
	for {
		n, err := c.Read(buf)
		got = append(got, buf[:n]...)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("connection still open after the CONNECT; read % x", got)
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				t.Logf("read: %v", err) // a reset closes it too
			}
			return got
		}
	}
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

// Bytes after the last field the connect flags announce are a fault of the
// packet (3.1.1 [MQTT-3.1.2-18], [MQTT-3.1.2-20]; MQTT 5 [MQTT-3.1.2-16],
// [MQTT-3.1.2-18]): a user name or password sent without its flag. 3.1.1
// closes without a CONNACK ([MQTT-3.1.4-1]); MQTT 5 says 0x81 first.
func TestBroker_ConnectFieldWithoutFlag(t *testing.T) {
	b, addr := startBroker(t, nil)
	before := testutil.ToFloat64(b.m.packetErrors.WithLabelValues("unreadable_connect"))
	got := connectReply(t, addr, connectBytes("MQTT", 4, 0x02, nil, "c", "user"))
	require.Empty(t, got, "3.1.1, user name without its flag: closed without a CONNACK; got % x", got)
	got = connectReply(t, addr, connectBytes("MQTT", 4, 0x02|0x80, nil, "c", "user", "pw"))
	require.Empty(t, got, "3.1.1, password without its flag: closed without a CONNACK; got % x", got)
	got = connectReply(t, addr, connectBytes("MQTT", 5, 0x02|0x40, nil, "c", "user", "pw"))
	require.GreaterOrEqual(t, len(got), 4, "MQTT 5: CONNACK; got % x", got)
	require.Equal(t, []byte{0x20, 0x00, 0x81}, []byte{got[0], got[2], got[3]}, "MQTT 5: CONNACK 0x81; got % x", got)
	require.Eventually(t, func() bool {
		return testutil.ToFloat64(b.m.packetErrors.WithLabelValues("unreadable_connect")) == before+3
	}, time.Second, 10*time.Millisecond)
}
