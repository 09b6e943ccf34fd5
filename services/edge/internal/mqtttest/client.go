// Package mqtttest is a minimal MQTT client on mochi's packet codec, for
// tests that need exact control over what goes on the wire: stop reading,
// send malformed bytes, check reason codes.
package mqtttest

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"
)

// Client is a minimal MQTT client built on mochi's packet codec, for tests
// that need exact control: stop reading, send malformed bytes, check codes.
type Client struct {
	t       testing.TB
	Conn    net.Conn
	r       *bufio.Reader
	version byte
	backlog []packets.Packet // PUBLISHes that arrived while waiting for something else
}

// Dial connects to addr speaking the given protocol version (3, 4 or 5).
func Dial(t testing.TB, addr string, version byte) *Client {
	t.Helper()
	return DialFrom(t, nil, addr, version)
}

// DialFrom is Dial from the local address from (nil: any), as a client on
// another host appears to a server on loopback (127.0.0.2, say).
func DialFrom(t testing.TB, from net.Addr, addr string, version byte) *Client {
	t.Helper()
	d := net.Dialer{Timeout: 2 * time.Second, LocalAddr: from}
	c, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return &Client{t: t, Conn: c, r: bufio.NewReader(c), version: version}
}

func (c *Client) Send(pk packets.Packet) {
	c.t.Helper()
	require.NoError(c.t, c.Write(pk))
}

// Write sends pk and returns the connection's error, for a reader that
// expects its connection to be closed under it (a takeover).
func (c *Client) Write(pk packets.Packet) error {
	pk.ProtocolVersion = c.version
	var buf bytes.Buffer
	var err error
	switch pk.FixedHeader.Type {
	case packets.Connect:
		err = pk.ConnectEncode(&buf)
	case packets.Publish:
		err = pk.PublishEncode(&buf)
	case packets.Puback:
		err = pk.PubackEncode(&buf)
	case packets.Pubrec:
		err = pk.PubrecEncode(&buf)
	case packets.Pubrel:
		err = pk.PubrelEncode(&buf)
	case packets.Pubcomp:
		err = pk.PubcompEncode(&buf)
	case packets.Subscribe:
		err = pk.SubscribeEncode(&buf)
	case packets.Unsubscribe:
		err = pk.UnsubscribeEncode(&buf)
	case packets.Disconnect:
		err = pk.DisconnectEncode(&buf)
	case packets.Pingreq:
		err = pk.PingreqEncode(&buf)
	default:
		err = fmt.Errorf("test client cannot encode %d", pk.FixedHeader.Type)
	}
	if err != nil {
		return err
	}
	_, err = c.Conn.Write(buf.Bytes())
	return err
}

// read returns the next packet, or an error (io.EOF when closed).
func (c *Client) Read(timeout time.Duration) (packets.Packet, error) {
	_ = c.Conn.SetReadDeadline(time.Now().Add(timeout))
	var pk packets.Packet
	hb, err := c.r.ReadByte()
	if err != nil {
		return pk, err
	}
	if err := pk.FixedHeader.Decode(hb); err != nil {
		return pk, err
	}
	n, mult := 0, 1
	for {
		b, err := c.r.ReadByte()
		if err != nil {
			return pk, err
		}
		n += int(b&127) * mult
		mult *= 128
		if b&128 == 0 {
			break
		}
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(c.r, body); err != nil {
		return pk, err
	}
	pk.ProtocolVersion = c.version
	pk.FixedHeader.Remaining = n
	switch pk.FixedHeader.Type {
	case packets.Connack:
		err = pk.ConnackDecode(body)
	case packets.Publish:
		err = pk.PublishDecode(body)
	case packets.Puback:
		err = pk.PubackDecode(body)
	case packets.Pubrec:
		err = pk.PubrecDecode(body)
	case packets.Pubrel:
		err = pk.PubrelDecode(body)
	case packets.Pubcomp:
		err = pk.PubcompDecode(body)
	case packets.Suback:
		err = pk.SubackDecode(body)
	case packets.Unsuback:
		err = pk.UnsubackDecode(body)
	case packets.Disconnect:
		err = pk.DisconnectDecode(body)
	case packets.Pingresp:
	}
	return pk, err
}

// expect returns the next packet of type typ. PUBLISHes that arrive first
// are kept for a later expect(Publish): the server may send retained
// messages before the SUBACK ([MQTT-3.8.4]).
func (c *Client) Expect(typ byte) packets.Packet {
	c.t.Helper()
	if typ == packets.Publish && len(c.backlog) > 0 {
		pk := c.backlog[0]
		c.backlog = c.backlog[1:]
		return pk
	}
	for {
		pk, err := c.Read(5 * time.Second)
		require.NoError(c.t, err, "waiting for packet type %d", typ)
		if pk.FixedHeader.Type == typ {
			return pk
		}
		if pk.FixedHeader.Type == packets.Publish {
			c.backlog = append(c.backlog, pk)
		}
	}
}

func (c *Client) Connect(id string, clean bool, props packets.Properties) packets.Packet {
	c.t.Helper()
	protoName := []byte("MQTT")
	if c.version == 3 {
		protoName = []byte("MQIsdp")
	}
	c.Send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect:     packets.ConnectParams{ProtocolName: protoName, Clean: clean, Keepalive: 30, ClientIdentifier: id},
		Properties:  props,
	})
	return c.Expect(packets.Connack)
}

// ConnectAs connects with a user name and password.
func (c *Client) ConnectAs(id, user, password string, clean bool, props packets.Properties) packets.Packet {
	c.t.Helper()
	c.Send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: clean, Keepalive: 30, ClientIdentifier: id,
			UsernameFlag: true, Username: []byte(user), PasswordFlag: true, Password: []byte(password)},
		Properties: props,
	})
	return c.Expect(packets.Connack)
}

func (c *Client) Subscribe(id uint16, filter string, qos byte) packets.Packet {
	c.t.Helper()
	c.Send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1},
		PacketID:    id,
		Filters:     packets.Subscriptions{{Filter: filter, Qos: qos}},
	})
	return c.Expect(packets.Suback)
}

func (c *Client) Publish(id uint16, topic string, qos byte, payload []byte) {
	c.t.Helper()
	c.Send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos},
		PacketID:    id,
		TopicName:   topic,
		Payload:     payload,
	})
}
