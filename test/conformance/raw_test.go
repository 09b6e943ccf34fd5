package conformance

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/stretchr/testify/require"
)

// rawClient speaks MQTT packet by packet over one TCP connection, for exact
// checks of reason codes, flow control and malformed input. It is used from
// the test goroutine only.
type rawClient struct {
	conn net.Conn
	br   *bufio.Reader
}

func dialRaw(t *testing.T, addr string) *rawClient {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return newRawClient(conn)
}

func newRawClient(conn net.Conn) *rawClient {
	return &rawClient{conn: conn, br: bufio.NewReader(conn)}
}

// rawConnect returns an MQTT 5 CONNECT for clientID with clean start and a
// 30 s keep alive.
func rawConnect(clientID string) *packets.Connect {
	return &packets.Connect{
		ProtocolName:    "MQTT",
		ProtocolVersion: 5,
		ClientID:        clientID,
		CleanStart:      true,
		KeepAlive:       30,
		Properties:      &packets.Properties{},
	}
}

// connectRaw dials addr, sends cp and requires a successful CONNACK.
func connectRaw(t *testing.T, addr string, cp *packets.Connect) (*rawClient, *packets.Connack) {
	t.Helper()
	c := dialRaw(t, addr)
	c.send(t, cp)
	ca := c.expect(t, packets.CONNACK).Content.(*packets.Connack)
	require.Equal(t, byte(0), ca.ReasonCode, "CONNACK reason code (%s)", reasonString(ca.Properties))
	return c, ca
}

// packetWriter is any paho.golang packet.
type packetWriter interface {
	WriteTo(w io.Writer) (int64, error)
}

func (c *rawClient) send(t *testing.T, p packetWriter) {
	t.Helper()
	_ = c.conn.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, err := p.WriteTo(c.conn)
	require.NoError(t, err)
}

func (c *rawClient) sendBytes(t *testing.T, b []byte) {
	t.Helper()
	_ = c.conn.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, err := c.conn.Write(b)
	require.NoError(t, err)
}

// readFrame reads one whole packet, fixed header included.
func (c *rawClient) readFrame(timeout time.Duration) ([]byte, error) {
	_ = c.conn.SetReadDeadline(time.Now().Add(timeout))
	first, err := c.br.ReadByte()
	if err != nil {
		return nil, err
	}
	raw := []byte{first}
	n, mult := 0, 1
	for i := 0; ; i++ {
		b, err := c.br.ReadByte()
		if err != nil {
			return nil, err
		}
		raw = append(raw, b)
		n += int(b&0x7f) * mult
		if b&0x80 == 0 {
			break
		}
		if i == 3 {
			return nil, errors.New("malformed remaining length")
		}
		mult *= 128
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(c.br, body); err != nil {
		return nil, err
	}
	return append(raw, body...), nil
}

// read reads and decodes one MQTT 5 packet.
func (c *rawClient) read(timeout time.Duration) (*packets.ControlPacket, []byte, error) {
	raw, err := c.readFrame(timeout)
	if err != nil {
		return nil, nil, err
	}
	cp, err := packets.ReadPacket(bytes.NewReader(raw))
	return cp, raw, err
}

// expect reads the next packet and requires it to be of type typ.
func (c *rawClient) expect(t *testing.T, typ byte) *packets.ControlPacket {
	t.Helper()
	cp, _, err := c.read(waitMsg)
	require.NoError(t, err, "waiting for packet type %d", typ)
	require.Equal(t, typ, cp.Type, "packet type; got %s", cp)
	return cp
}

// expectPublish reads the next packet, requires a PUBLISH and returns it with
// its wire bytes.
func (c *rawClient) expectPublish(t *testing.T) (*packets.Publish, []byte) {
	t.Helper()
	cp, raw, err := c.read(waitMsg)
	require.NoError(t, err, "waiting for PUBLISH")
	require.Equal(t, packets.PUBLISH, cp.Type, "packet type; got %s", cp)
	return cp.Content.(*packets.Publish), raw
}

// expectSilence requires that no packet arrives within d.
func (c *rawClient) expectSilence(t *testing.T, d time.Duration) {
	t.Helper()
	cp, _, err := c.read(d)
	if err == nil {
		t.Fatalf("unexpected packet: %s", cp)
	}
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "connection failed while waiting")
}

// expectClosed reads until the server closes the connection, which must
// happen within d, and returns the DISCONNECT it sent first, if any, and
// how long the close took.
func (c *rawClient) expectClosed(t *testing.T, d time.Duration) (*packets.Disconnect, time.Duration) {
	t.Helper()
	start := time.Now()
	var disc *packets.Disconnect
	for {
		raw, err := c.readFrame(time.Until(start.Add(d)))
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("connection still open after %v", d)
			}
			return disc, time.Since(start)
		}
		if raw[0]>>4 == packets.DISCONNECT {
			cp, err := packets.ReadPacket(bytes.NewReader(raw))
			if err == nil {
				disc = cp.Content.(*packets.Disconnect)
			}
		}
	}
}

// requireReason checks the DISCONNECT a server sent before it closed the
// connection (d, from expectClosed): it carries one of codes. The spec
// lets a server close without one ([MQTT-4.13.1-1]: it MAY send a
// DISCONNECT), so only keel-edge, which always says why, must send it.
func requireReason(t *testing.T, e *edge, d *packets.Disconnect, codes ...byte) {
	t.Helper()
	if d == nil {
		if !e.external {
			t.Fatalf("connection closed without a DISCONNECT; keel-edge sends one with reason %x", codes)
		}
		return
	}
	require.Contains(t, codes, d.ReasonCode, "DISCONNECT reason code 0x%02x", d.ReasonCode)
}

// expectOpen requires the connection to answer a PINGREQ.
func (c *rawClient) expectOpen(t *testing.T) {
	t.Helper()
	c.sendBytes(t, []byte{0xc0, 0x00})
	deadline := time.Now().Add(waitMsg)
	for {
		raw, err := c.readFrame(time.Until(deadline))
		require.NoError(t, err, "connection closed; expected it open")
		if raw[0] == 0xd0 {
			return
		}
	}
}

func reasonString(p *packets.Properties) string {
	if p == nil {
		return ""
	}
	return p.ReasonString
}

// publishSubIDs returns every Subscription Identifier of a raw MQTT 5
// PUBLISH; paho keeps only the last one.
func publishSubIDs(t *testing.T, raw []byte) []int {
	t.Helper()
	i := 1
	for raw[i]&0x80 != 0 {
		i++
	}
	i++
	qos := (raw[0] >> 1) & 3
	i += 2 + int(binary.BigEndian.Uint16(raw[i:]))
	if qos > 0 {
		i += 2
	}
	plen, n := decodeVBI(raw[i:])
	i += n
	props := raw[i : i+plen]
	var ids []int
	for j := 0; j < len(props); {
		id := props[j]
		j++
		switch id {
		case 0x01: // payload format indicator
			j++
		case 0x02: // message expiry interval
			j += 4
		case 0x23: // topic alias
			j += 2
		case 0x03, 0x08, 0x09: // content type, response topic, correlation data
			j += 2 + int(binary.BigEndian.Uint16(props[j:]))
		case 0x26: // user property
			j += 2 + int(binary.BigEndian.Uint16(props[j:]))
			j += 2 + int(binary.BigEndian.Uint16(props[j:]))
		case 0x0b: // subscription identifier
			v, n := decodeVBI(props[j:])
			ids = append(ids, v)
			j += n
		default:
			t.Fatalf("unexpected PUBLISH property 0x%02x", id)
		}
	}
	return ids
}

func decodeVBI(b []byte) (value, n int) {
	mult := 1
	for i, c := range b {
		value += int(c&0x7f) * mult
		if c&0x80 == 0 {
			return value, i + 1
		}
		mult *= 128
	}
	return value, len(b)
}

// ---------------------------------------------------------------- MQTT 3.1.1 wire

func appendVBI(b []byte, n int) []byte {
	for {
		d := byte(n % 128)
		n /= 128
		if n > 0 {
			d |= 0x80
		}
		b = append(b, d)
		if n == 0 {
			return b
		}
	}
}

func appendStr(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...)
}

func frame(header byte, body []byte) []byte {
	return append(appendVBI([]byte{header}, len(body)), body...)
}

// v311Conn describes an MQTT 3.1.1 CONNECT.
type v311Conn struct {
	clientID, user, password string
	keepAlive                uint16
	persistent               bool // clean session 0
	willTopic, willPayload   string
	willQoS                  byte
	willRetain               bool
}

func (c v311Conn) bytes() []byte {
	flags := byte(0)
	if !c.persistent {
		flags |= 0x02
	}
	if c.willTopic != "" {
		flags |= 0x04 | c.willQoS<<3
		if c.willRetain {
			flags |= 0x20
		}
	}
	if c.user != "" {
		flags |= 0x80
	}
	if c.password != "" {
		flags |= 0x40
	}
	body := appendStr(nil, "MQTT")
	body = append(body, 4, flags)
	body = binary.BigEndian.AppendUint16(body, c.keepAlive)
	body = appendStr(body, c.clientID)
	if c.willTopic != "" {
		body = appendStr(body, c.willTopic)
		body = appendStr(body, c.willPayload)
	}
	if c.user != "" {
		body = appendStr(body, c.user)
	}
	if c.password != "" {
		body = appendStr(body, c.password)
	}
	return frame(0x10, body)
}

func v311Publish(topic string, qos byte, packetID uint16, payload string) []byte {
	body := appendStr(nil, topic)
	if qos > 0 {
		body = binary.BigEndian.AppendUint16(body, packetID)
	}
	return frame(0x30|qos<<1, append(body, payload...))
}

func v311Subscribe(packetID uint16, qos byte, filters ...string) []byte {
	body := binary.BigEndian.AppendUint16(nil, packetID)
	for _, f := range filters {
		body = append(appendStr(body, f), qos)
	}
	return frame(0x82, body)
}

// connectV311Raw dials addr, sends c and returns the CONNACK return code.
func connectV311Raw(t *testing.T, addr string, c v311Conn) (*rawClient, byte) {
	t.Helper()
	rc := dialRaw(t, addr)
	rc.sendBytes(t, c.bytes())
	raw, err := rc.readFrame(waitMsg)
	require.NoError(t, err, "waiting for CONNACK")
	require.Equal(t, []byte{0x20, 0x02}, raw[:2], "CONNACK header: % x", raw)
	return rc, raw[3]
}

// v311Suback reads a SUBACK and returns its return codes.
func (c *rawClient) v311Suback(t *testing.T) []byte {
	t.Helper()
	raw, err := c.readFrame(waitMsg)
	require.NoError(t, err, "waiting for SUBACK")
	require.Equal(t, byte(0x90), raw[0], "packet: % x", raw)
	_, n := decodeVBI(raw[1:])
	return raw[1+n+2:]
}

// v5WillConnect encodes an MQTT 5 CONNECT (clean start, no properties) with a
// will whose properties are packed like PUBLISH properties. paho.golang
// v0.23.0 packs will properties as CONNECT properties and so drops Content
// Type, Response Topic, Correlation Data and Payload Format Indicator.
func v5WillConnect(clientID, willTopic, willPayload string, willQoS byte, willProps *packets.Properties) []byte {
	body := appendStr(nil, "MQTT")
	body = append(body, 5, 0x02|0x04|willQoS<<3)
	body = binary.BigEndian.AppendUint16(body, 30)
	body = appendVBI(body, 0)
	body = appendStr(body, clientID)
	wp := willProps.Pack(packets.PUBLISH)
	body = append(appendVBI(body, len(wp)), wp...)
	body = appendStr(body, willTopic)
	body = appendStr(body, willPayload)
	return frame(0x10, body)
}

// v311ExpectPublish reads the next packet of a 3.1.1 connection, which must
// be a QoS 1 or 2 PUBLISH, and returns its payload and packet identifier.
func (c *rawClient) v311ExpectPublish(t *testing.T) (string, uint16) {
	t.Helper()
	raw, err := c.readFrame(waitMsg)
	require.NoError(t, err, "waiting for PUBLISH")
	require.Equal(t, byte(packets.PUBLISH), raw[0]>>4, "packet type")
	require.NotZero(t, raw[0]&0x06, "QoS 1 or 2")
	_, n := decodeVBI(raw[1:])
	body := raw[1+n:]
	tl := int(body[0])<<8 | int(body[1])
	id := uint16(body[2+tl])<<8 | uint16(body[3+tl])
	return string(body[4+tl:]), id
}
