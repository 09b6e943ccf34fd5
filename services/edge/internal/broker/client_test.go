package broker

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/listener"
)

// startBroker runs a broker with anonymous access on a loopback port.
func startBroker(t *testing.T, mutate func(*Config)) (*Broker, string) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.EdgeID = "test"
	if mutate != nil {
		mutate(&cfg)
	}
	b, err := New(cfg, auth.Anonymous{Tenant: "default"}, testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
	require.NoError(t, b.AddListener(l))
	require.NoError(t, b.Serve())
	t.Cleanup(func() { _ = b.Close() })
	return b, l.Address()
}

func anonymous() auth.Authenticator { return auth.Anonymous{Tenant: "default"} }

func newTCP(addr string) *listener.TCP {
	return listener.NewTCP("tcp", addr, nil)
}

// rawClient is a minimal MQTT client built on mochi's packet codec, for tests
// that need exact control: stop reading, send malformed bytes, check codes.
type rawClient struct {
	t       testing.TB
	conn    net.Conn
	r       *bufio.Reader
	version byte
	backlog []packets.Packet // PUBLISHes that arrived while waiting for something else
}

func dial(t testing.TB, addr string, version byte) *rawClient {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return &rawClient{t: t, conn: c, r: bufio.NewReader(c), version: version}
}

func (c *rawClient) send(pk packets.Packet) {
	c.t.Helper()
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
	require.NoError(c.t, err)
	_, err = c.conn.Write(buf.Bytes())
	require.NoError(c.t, err)
}

// read returns the next packet, or an error (io.EOF when closed).
func (c *rawClient) read(timeout time.Duration) (packets.Packet, error) {
	_ = c.conn.SetReadDeadline(time.Now().Add(timeout))
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
func (c *rawClient) expect(typ byte) packets.Packet {
	c.t.Helper()
	if typ == packets.Publish && len(c.backlog) > 0 {
		pk := c.backlog[0]
		c.backlog = c.backlog[1:]
		return pk
	}
	for {
		pk, err := c.read(5 * time.Second)
		require.NoError(c.t, err, "waiting for packet type %d", typ)
		if pk.FixedHeader.Type == typ {
			return pk
		}
		if pk.FixedHeader.Type == packets.Publish {
			c.backlog = append(c.backlog, pk)
		}
	}
}

func (c *rawClient) connect(id string, clean bool, props packets.Properties) packets.Packet {
	c.t.Helper()
	protoName := []byte("MQTT")
	if c.version == 3 {
		protoName = []byte("MQIsdp")
	}
	c.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect:     packets.ConnectParams{ProtocolName: protoName, Clean: clean, Keepalive: 30, ClientIdentifier: id},
		Properties:  props,
	})
	return c.expect(packets.Connack)
}

func (c *rawClient) subscribe(id uint16, filter string, qos byte) packets.Packet {
	c.t.Helper()
	c.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1},
		PacketID:    id,
		Filters:     packets.Subscriptions{{Filter: filter, Qos: qos}},
	})
	return c.expect(packets.Suback)
}

func (c *rawClient) publish(id uint16, topic string, qos byte, payload []byte) {
	c.t.Helper()
	c.send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos},
		PacketID:    id,
		TopicName:   topic,
		Payload:     payload,
	})
}
