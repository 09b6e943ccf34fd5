package conformance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/stretchr/testify/require"
)

const (
	// waitMsg bounds how long a message or packet that must arrive may take.
	waitMsg = 3 * time.Second
	// quiet is how long a test watches for a message that must not arrive,
	// after a later marker message has already arrived.
	quiet = 200 * time.Millisecond
)

// uniq returns a short random string that keeps the client IDs and topics
// of concurrently running tests apart (also on a shared external broker).
func uniq() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// topicFor returns a topic prefix unique to one test.
func topicFor(t *testing.T) string {
	name := strings.TrimPrefix(t.Name(), "TestConformance_")
	name = strings.NewReplacer("/", "-", "#", "", "+", "", "$", "").Replace(name)
	return "conf/" + strings.ToLower(name) + "-" + uniq()
}

// eventually polls f every 20 ms until it returns nil, failing the test with
// f's last error after timeout.
func eventually(t *testing.T, timeout time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %v: %v", timeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func u16(v uint16) *uint16 { return &v }
func u32(v uint32) *uint32 { return &v }
func intp(v int) *int      { return &v }
func bytep(v byte) *byte   { return &v }

// ---------------------------------------------------------------- MQTT 5

// v5Client is a paho.golang MQTT 5 client that records what it receives.
type v5Client struct {
	*paho.Client
	Connack *paho.Connack
	msgs    chan *paho.Publish // received messages; a test expects far fewer than it holds
	discs   chan *paho.Disconnect
}

// v5Connect returns a CONNECT for clientID with clean start, a 30 s keep
// alive and problem information requested.
func v5Connect(clientID string) *paho.Connect {
	return &paho.Connect{
		ClientID:   clientID,
		CleanStart: true,
		KeepAlive:  30,
		Properties: &paho.ConnectProperties{RequestProblemInfo: true},
	}
}

// withAuth sets the user name and password of cp.
func withAuth(cp *paho.Connect, user, password string) *paho.Connect {
	cp.Username, cp.UsernameFlag = user, true
	cp.Password, cp.PasswordFlag = []byte(password), true
	return cp
}

// dialV5 connects an MQTT 5 client. On a refused connection it returns the
// client (with its Connack, if one came) and an error.
func dialV5(t *testing.T, addr string, cp *paho.Connect) (*v5Client, error) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	return startV5(t, conn, cp)
}

func startV5(t *testing.T, conn net.Conn, cp *paho.Connect) (*v5Client, error) {
	t.Helper()
	c := &v5Client{msgs: make(chan *paho.Publish, 4096), discs: make(chan *paho.Disconnect, 4)}
	c.Client = paho.NewClient(paho.ClientConfig{
		// paho writes a packet in several Write calls; the lock keeps
		// packets from concurrent writers (the pinger) whole on TLS and
		// WebSocket connections.
		Conn: packets.NewThreadSafeConn(conn),
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			select { // never block paho: a "#" subscriber may see a lot
			case c.msgs <- pr.Packet:
			default:
			}
			return true, nil
		}},
		OnServerDisconnect: func(d *paho.Disconnect) {
			select {
			case c.discs <- d:
			default:
			}
		},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ca, err := c.Connect(ctx, cp)
	c.Connack = ca
	if err != nil {
		return c, err
	}
	t.Cleanup(func() { _ = c.Disconnect(&paho.Disconnect{ReasonCode: 0}) })
	return c, nil
}

// connectV5 connects an MQTT 5 client and fails the test if it is refused.
func connectV5(t *testing.T, addr string, cp *paho.Connect) *v5Client {
	t.Helper()
	c, err := dialV5(t, addr, cp)
	require.NoError(t, err, "connect %q", cp.ClientID)
	return c
}

// sub subscribes to filter at qos and requires it granted.
func (c *v5Client) sub(t *testing.T, filter string, qos byte) {
	t.Helper()
	c.subscribe(t, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: qos}}})
}

// subscribe sends s and requires every subscription granted.
func (c *v5Client) subscribe(t *testing.T, s *paho.Subscribe) *paho.Suback {
	t.Helper()
	sa, err := c.trySubscribe(s)
	require.NoError(t, err, "subscribe %+v", s.Subscriptions)
	require.Len(t, sa.Reasons, len(s.Subscriptions))
	for i, r := range sa.Reasons {
		require.Less(t, r, byte(0x80), "SUBACK reason for %q", s.Subscriptions[i].Topic)
	}
	return sa
}

// trySubscribe sends s and returns the SUBACK, whatever its reason codes.
func (c *v5Client) trySubscribe(s *paho.Subscribe) (*paho.Suback, error) {
	ctx, cancel := context.WithTimeout(context.Background(), waitMsg)
	defer cancel()
	sa, err := c.Subscribe(ctx, s)
	if sa != nil {
		return sa, nil
	}
	return nil, err
}

// pub publishes payload to topic at qos and requires success.
func (c *v5Client) pub(t *testing.T, topic string, qos byte, payload string) {
	t.Helper()
	c.publish(t, &paho.Publish{Topic: topic, QoS: qos, Payload: []byte(payload)})
}

// publish sends p and requires a successful acknowledgement.
func (c *v5Client) publish(t *testing.T, p *paho.Publish) {
	t.Helper()
	pr, err := c.tryPublish(p)
	require.NoError(t, err, "publish to %q", p.Topic)
	if pr != nil {
		require.Less(t, pr.ReasonCode, byte(0x80), "publish to %q: reason code", p.Topic)
	}
}

// tryPublish sends p and returns the acknowledgement, whatever its reason code.
func (c *v5Client) tryPublish(p *paho.Publish) (*paho.PublishResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), waitMsg)
	defer cancel()
	pr, err := c.Publish(ctx, p)
	if pr != nil {
		return pr, nil
	}
	return nil, err
}

// next returns the next message received, failing the test after waitMsg.
func (c *v5Client) next(t *testing.T) *paho.Publish {
	t.Helper()
	select {
	case m := <-c.msgs:
		return m
	case <-time.After(waitMsg):
		t.Fatalf("no message within %v", waitMsg)
		return nil
	}
}

// expectPayloads requires the next messages to carry exactly want, in order.
func (c *v5Client) expectPayloads(t *testing.T, want ...string) []*paho.Publish {
	t.Helper()
	var got []*paho.Publish
	for i := range want {
		m := c.next(t)
		got = append(got, m)
		require.Equal(t, want[i], string(m.Payload), "message %d of %v (topic %q)", i, want, m.Topic)
	}
	return got
}

// expectNothing requires that no message arrives within d.
func (c *v5Client) expectNothing(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case m := <-c.msgs:
		t.Fatalf("unexpected message on %q: %q", m.Topic, m.Payload)
	case <-time.After(d):
	}
}

// expectDisconnect waits for a DISCONNECT from the server.
func (c *v5Client) expectDisconnect(t *testing.T) *paho.Disconnect {
	t.Helper()
	select {
	case d := <-c.discs:
		return d
	case <-time.After(waitMsg):
		t.Fatalf("no DISCONNECT from the server within %v", waitMsg)
		return nil
	}
}

// drop closes the network connection without a DISCONNECT.
func (c *v5Client) drop() {
	c.TerminateConnectionForTest()
	<-c.Done()
}

// ---------------------------------------------------------------- MQTT 3.1.1

// v3Client is a paho.mqtt.golang MQTT 3.1.1 client that records what it
// receives.
type v3Client struct {
	mqtt.Client
	msgs chan mqtt.Message
	lost chan error
}

// v3Options returns options for a clean-session MQTT 3.1.1 client of url
// (tcp://, ws://, tls://) that never reconnects by itself.
func v3Options(url, clientID string) *mqtt.ClientOptions {
	return mqtt.NewClientOptions().
		AddBroker(url).
		SetClientID(clientID).
		SetProtocolVersion(4).
		SetCleanSession(true).
		SetAutoReconnect(false).
		SetConnectRetry(false).
		SetKeepAlive(30 * time.Second).
		SetConnectTimeout(5 * time.Second).
		SetWriteTimeout(5 * time.Second)
}

// connectV3 connects a 3.1.1 client and fails the test if it is refused.
func connectV3(t *testing.T, opts *mqtt.ClientOptions) *v3Client {
	t.Helper()
	c, err := dialV3(t, opts)
	require.NoError(t, err)
	return c
}

func dialV3(t *testing.T, opts *mqtt.ClientOptions) (*v3Client, error) {
	t.Helper()
	c := &v3Client{msgs: make(chan mqtt.Message, 4096), lost: make(chan error, 1)}
	opts.SetDefaultPublishHandler(func(_ mqtt.Client, m mqtt.Message) {
		select {
		case c.msgs <- m:
		default:
		}
	})
	opts.SetConnectionLostHandler(func(_ mqtt.Client, err error) {
		select {
		case c.lost <- err:
		default:
		}
	})
	c.Client = mqtt.NewClient(opts)
	tok := c.Connect()
	if !tok.WaitTimeout(5 * time.Second) {
		return nil, errors.New("connect timed out")
	}
	if err := tok.Error(); err != nil {
		return nil, err
	}
	t.Cleanup(func() { c.Disconnect(50) })
	return c, nil
}

func (c *v3Client) sub(t *testing.T, filter string, qos byte) {
	t.Helper()
	tok := c.Subscribe(filter, qos, nil)
	require.True(t, tok.WaitTimeout(waitMsg), "SUBACK for %q", filter)
	require.NoError(t, tok.Error())
	granted := tok.(*mqtt.SubscribeToken).Result()[filter]
	require.Less(t, granted, byte(0x80), "SUBACK return code for %q", filter)
}

func (c *v3Client) pub(t *testing.T, topic string, qos byte, retain bool, payload string) {
	t.Helper()
	tok := c.Publish(topic, qos, retain, payload)
	require.True(t, tok.WaitTimeout(waitMsg), "publish to %q not acknowledged", topic)
	require.NoError(t, tok.Error())
}

func (c *v3Client) next(t *testing.T) mqtt.Message {
	t.Helper()
	select {
	case m := <-c.msgs:
		return m
	case <-time.After(waitMsg):
		t.Fatalf("no message within %v", waitMsg)
		return nil
	}
}

func (c *v3Client) expectPayloads(t *testing.T, want ...string) []mqtt.Message {
	t.Helper()
	var got []mqtt.Message
	for i := range want {
		m := c.next(t)
		got = append(got, m)
		require.Equal(t, want[i], string(m.Payload()), "message %d of %v (topic %q)", i, want, m.Topic())
	}
	return got
}

func (c *v3Client) expectNothing(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case m := <-c.msgs:
		t.Fatalf("unexpected message on %q: %q", m.Topic(), m.Payload())
	case <-time.After(d):
	}
}

// payloads formats n payloads "prefix-0" … "prefix-(n-1)".
func payloads(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d", prefix, i)
	}
	return out
}
