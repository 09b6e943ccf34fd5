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

// sendOnNewConn dials addr, writes pkt and gives the connection 3 s to
// answer.
func sendOnNewConn(t *testing.T, addr string, pkt []byte) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	require.NoError(t, err)
	_, err = c.Write(pkt)
	require.NoError(t, err)
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	return c
}

// connectReply sends a CONNECT and returns what the edge wrote before it
// closed the connection; it fails if the connection stays open.
func connectReply(t *testing.T, addr string, pkt []byte) []byte {
	t.Helper()
	c := sendOnNewConn(t, addr, pkt)
	defer c.Close()
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

// A CONNECT that breaks the rules of section 3.1 is refused before anything
// else happens: an MQTT 3.1.1 or 3.1 client gets the return code its
// version defines for the fault, or, where none applies, the connection
// closed without a CONNACK ([MQTT-3.1.4-1], [MQTT-3.2.2-6]); an MQTT 5
// client gets a CONNACK with the precise reason code before the close
// (§4.13). Each refusal is counted by its cause.
func TestBroker_ConnectValidation(t *testing.T) {
	b, addr := startBroker(t, nil)
	authMethod := append([]byte{0x15}, binary.BigEndian.AppendUint16(nil, 5)...)
	authMethod = append(authMethod, "basic"...)
	const (
		clean    = 0x02
		will     = 0x04
		password = 0x40
		username = 0x80
	)
	for _, tc := range []struct {
		name  string
		pkt   []byte
		reply []byte // exact bytes for 3.x; for 5 the CONNACK's first four bytes but the length
		cause string // keel_edge_packet_errors_total reason; "" none
	}{
		// 3.1.1 [MQTT-3.1.2-2]: an unsupported level gets return code 0x01.
		{"MQTT-3.1.2-2 MQIsdp level 0", connectBytes("MQIsdp", 0, clean, nil, "c"), []byte{0x20, 2, 0, 0x01}, "protocol_version"},
		{"MQTT-3.1.2-2 MQTT level 3", connectBytes("MQTT", 3, clean, nil, "c"), []byte{0x20, 2, 0, 0x01}, "protocol_version"},
		// MQTT 5 [MQTT-3.1.2-2]: a level other than 5 MAY get 0x84.
		{"MQTT-3.1.2-2 MQTT level 6", connectBytes("MQTT", 6, clean, nil, "c"), []byte{0x20, 0, 0, 0x84}, "protocol_version"},
		// [MQTT-3.1.2-1]: a protocol name the server does not know: closed.
		{"MQTT-3.1.2-1 protocol name", connectBytes("MQTX", 4, clean, nil, "c"), nil, "protocol_name"},
		// [MQTT-3.1.2-3]: the reserved flag set; a Malformed Packet in MQTT 5.
		{"MQTT-3.1.2-3 reserved flag 3.1.1", connectBytes("MQTT", 4, clean|1, nil, "c"), nil, "connect_reserved_flag"},
		{"MQTT-3.1.2-3 reserved flag 5", connectBytes("MQTT", 5, clean|1, nil, "c"), []byte{0x20, 0, 0, 0x81}, "connect_reserved_flag"},
		// MQTT 3.1 (§3.1, Client Identifier): 1 to 23 characters; an empty
		// one is rejected with return code 2. Only 3.1.1 lets the server
		// assign one ([MQTT-3.1.3-6]).
		{"MQTT 3.1 empty client identifier", connectBytes("MQIsdp", 3, clean, nil, ""), []byte{0x20, 2, 0, 0x02}, "invalid_client_id"},
		// [MQTT-3.1.3-8]: empty client identifier with clean session 0.
		{"MQTT-3.1.3-8 empty client identifier, clean session 0", connectBytes("MQTT", 4, 0, nil, ""), []byte{0x20, 2, 0, 0x02}, "invalid_client_id"},
		// 3.1.1 [MQTT-3.1.2-22]: a password flag without the user name flag.
		{"MQTT-3.1.2-22 password without user name 3.1.1", connectBytes("MQTT", 4, clean|password, nil, "c", "pw"), nil, "password_without_username"},
		// [MQTT-1.5.3-2] / MQTT 5 [MQTT-1.5.4-2]: U+0000 in the user name.
		{"MQTT-1.5.3-2 user name with U+0000 3.1.1", connectBytes("MQTT", 4, clean|username, nil, "c", "a\x00b"), nil, "invalid_username"},
		{"MQTT-1.5.4-2 user name with U+0000 5", connectBytes("MQTT", 5, clean|username, nil, "c", "a\x00b"), []byte{0x20, 0, 0, 0x81}, "invalid_username"},
		{"MQTT-1.5.4-1 user name not UTF-8 5", connectBytes("MQTT", 5, clean|username, nil, "c", "\xc3\x28"), []byte{0x20, 0, 0, 0x81}, "invalid_username"},
		// [MQTT-4.7.3-1]: an empty will topic. 3.1.1 has no return code for
		// it ([MQTT-3.2.2-6]); MQTT 5 says 0x90 (Topic Name invalid).
		{"MQTT-4.7.3-1 empty will topic 3.1.1", connectBytes("MQTT", 4, clean|will, nil, "c", "", "payload"), nil, "invalid_will_topic"},
		{"MQTT-4.7.3-1 empty will topic 5", v5WillConnectBytes("c", "", "payload"), []byte{0x20, 0, 0, 0x90}, "invalid_will_topic"},
		// [MQTT-3.1.2-14] (3.1.1): will QoS 3; a Malformed Packet in MQTT 5.
		{"MQTT-3.1.2-14 will QoS 3 3.1.1", connectBytes("MQTT", 4, clean|will|3<<3, nil, "c", "w", "p"), nil, "invalid_will_flags"},
		// [MQTT-3.1.2-13] / [MQTT-3.1.2-15] (3.1.1): will QoS or retain without the will flag.
		{"MQTT-3.1.2-13 will QoS without will flag 3.1.1", connectBytes("MQTT", 4, clean|1<<3, nil, "c"), nil, "invalid_will_flags"},
		{"MQTT-3.1.2-15 will retain without will flag 3.1.1", connectBytes("MQTT", 4, clean|0x20, nil, "c"), nil, "invalid_will_flags"},
		// [MQTT-4.12.0-1]: an authentication method the server does not support.
		{"MQTT-4.12.0-1 unsupported authentication method", connectBytes("MQTT", 5, clean, authMethod, "c"), []byte{0x20, 0, 0, 0x8c}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before float64
			if tc.cause != "" {
				before = testutil.ToFloat64(b.m.packetErrors.WithLabelValues(tc.cause))
			}
			got := connectReply(t, addr, tc.pkt)
			switch {
			case tc.reply == nil:
				require.Empty(t, got, "closed without a CONNACK; got % x", got)
			case tc.reply[1] == 0: // MQTT 5: properties after the code
				require.GreaterOrEqual(t, len(got), 5, "CONNACK; got % x", got)
				require.Equal(t, []byte{0x20, 0, 0x00, tc.reply[3]}, []byte{got[0], 0, got[2], got[3]}, "CONNACK; got % x", got)
				require.Equal(t, int(got[1]), len(got)-2, "one CONNACK, then the close; got % x", got)
			default:
				require.Equal(t, tc.reply, got)
			}
			if tc.cause != "" {
				require.Equal(t, before+1, testutil.ToFloat64(b.m.packetErrors.WithLabelValues(tc.cause)))
			}
		})
	}
}

// A will message may be empty: a zero-length will payload is a valid
// Binary Data field (3.1.1 §3.1.3.3; MQTT 5 §3.1.3.4), and the will of a
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
