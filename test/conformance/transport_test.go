package conformance

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	mqtt "github.com/eclipse/paho.mqtt.golang"
	"github.com/gorilla/websocket"
	"github.com/stretchr/testify/require"
)

// TestConformance_WebSocket exchanges messages between WebSocket clients
// (MQTT 3.1.1 with paho.mqtt.golang, MQTT 5 with paho.golang over a
// WebSocket connection) and a TCP client.
func TestConformance_WebSocket(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	if e.WS == "" {
		t.Skipf("no WebSocket listener known; set %s", envWSAddr)
	}
	t.Run("mqtt311", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		ws := connectV3(t, v3Options("ws://"+e.WS+"/mqtt", "ws-"+uniq()))
		ws.sub(t, topic+"/to-ws", 1)
		tcp := connectV5(t, e.TCP, v5Connect("tcp-"+uniq()))
		tcp.sub(t, topic+"/to-tcp", 1)
		tcp.pub(t, topic+"/to-ws", 1, "hello ws")
		ws.expectPayloads(t, "hello ws")
		ws.pub(t, topic+"/to-tcp", 1, false, "hello tcp")
		tcp.expectPayloads(t, "hello tcp")
	})
	t.Run("mqtt5", func(t *testing.T) {
		t.Parallel()
		topic := topicFor(t)
		conn, resp, err := (&websocket.Dialer{Subprotocols: []string{"mqtt"}, HandshakeTimeout: 5 * time.Second}).
			Dial("ws://"+e.WS+"/mqtt", nil)
		require.NoError(t, err)
		_ = resp.Body.Close()
		// [MQTT-6.0.0-4]: the server selects the "mqtt" subprotocol.
		require.Equal(t, "mqtt", conn.Subprotocol())
		// paho writes each packet in several pieces, so packets span
		// WebSocket frames: [MQTT-6.0.0-2] the server must not assume
		// alignment.
		ws, err := startV5(t, &wsConn{ws: conn}, v5Connect("ws5-"+uniq()))
		require.NoError(t, err)
		ws.sub(t, topic, 1)
		tcp := connectV5(t, e.TCP, v5Connect("tcp-"+uniq()))
		tcp.pub(t, topic, 1, "hello ws5")
		ws.expectPayloads(t, "hello ws5")
		ws.pub(t, topic, 2, "echo")
		ws.expectPayloads(t, "echo")
	})
}

// wsConn adapts a WebSocket connection to net.Conn, one binary message per
// Write.
type wsConn struct {
	ws  *websocket.Conn
	r   io.Reader
	wmu sync.Mutex
}

func (c *wsConn) Read(p []byte) (int, error) {
	for {
		if c.r == nil {
			_, r, err := c.ws.NextReader()
			if err != nil {
				return 0, err
			}
			c.r = r
		}
		n, err := c.r.Read(p)
		if err == io.EOF {
			c.r = nil
			if n == 0 {
				continue
			}
			err = nil
		}
		return n, err
	}
}

func (c *wsConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.ws.WriteMessage(websocket.BinaryMessage, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (c *wsConn) Close() error                       { return c.ws.Close() }
func (c *wsConn) LocalAddr() net.Addr                { return c.ws.LocalAddr() }
func (c *wsConn) RemoteAddr() net.Addr               { return c.ws.RemoteAddr() }
func (c *wsConn) SetReadDeadline(t time.Time) error  { return c.ws.SetReadDeadline(t) }
func (c *wsConn) SetWriteDeadline(t time.Time) error { return c.ws.SetWriteDeadline(t) }
func (c *wsConn) SetDeadline(t time.Time) error {
	_ = c.ws.SetReadDeadline(t)
	return c.ws.SetWriteDeadline(t)
}

// TestConformance_TLS exchanges messages between clients on the TLS listener
// (MQTT 3.1.1 and 5) and a TCP client.
func TestConformance_TLS(t *testing.T) {
	t.Parallel()
	skipIfExternal(t, "a TLS listener with a test certificate")
	certPath, keyPath, cert := selfSignedCert(t)
	e := startEdge(t, "--tls.cert", certPath, "--tls.key", keyPath)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	tlsCfg := &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
	topic := topicFor(t)

	old := connectV3(t, v3Options("tls://"+e.TLS, "tls3-"+uniq()).SetTLSConfig(tlsCfg))
	old.sub(t, topic, 1)
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", e.TLS, tlsCfg)
	require.NoError(t, err)
	v5, err := startV5(t, conn, v5Connect("tls5-"+uniq()))
	require.NoError(t, err)
	v5.sub(t, topic, 1)
	tcp := connectV5(t, e.TCP, v5Connect("tcp-"+uniq()))
	tcp.pub(t, topic, 1, "over tls")
	old.expectPayloads(t, "over tls")
	v5.expectPayloads(t, "over tls")
	old.pub(t, topic, 1, false, "from tls")
	v5.expectPayloads(t, "from tls")

	_, err = tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", e.TLS, &tls.Config{MinVersion: tls.VersionTLS12})
	require.Error(t, err, "an untrusted certificate must fail verification")
}

// TestConformance_MosquittoClients round-trips messages through the
// mosquitto_pub and mosquitto_sub tools, MQTT 5 and 3.1.1.
func TestConformance_MosquittoClients(t *testing.T) {
	t.Parallel()
	for _, tool := range []string{"mosquitto_pub", "mosquitto_sub"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (Debian package mosquitto-clients)", tool)
		}
	}
	e := startEdge(t)
	host, port, err := net.SplitHostPort(e.TCP)
	require.NoError(t, err)
	run := func(t *testing.T, name string, args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, name, append([]string{"-h", host, "-p", port}, args...)...).CombinedOutput()
		require.NoError(t, err, "%s %v: %s", name, args, out)
		return string(out)
	}
	for _, version := range []string{"mqttv5", "mqttv311"} {
		t.Run(version+"_pub", func(t *testing.T) {
			t.Parallel()
			topic := topicFor(t)
			sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
			sub.sub(t, topic, 1)
			args := []string{"-V", version, "-q", "1", "-t", topic, "-m", "from mosquitto_pub"}
			if version == "mqttv5" {
				args = append(args, "-D", "publish", "user-property", "k", "v")
			}
			run(t, "mosquitto_pub", args...)
			m := sub.expectPayloads(t, "from mosquitto_pub")[0]
			if version == "mqttv5" {
				require.Equal(t, paho.UserProperties{{Key: "k", Value: "v"}}, m.Properties.User)
			}
		})
		t.Run(version+"_sub", func(t *testing.T) {
			t.Parallel()
			topic := topicFor(t)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var out bytes.Buffer
			cmd := exec.CommandContext(ctx, "mosquitto_sub", "-h", host, "-p", port, "-V", version, "-q", "1", "-t", topic, "-C", "1", "-W", "5")
			cmd.Stdout, cmd.Stderr = &out, &out
			require.NoError(t, cmd.Start())
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
			// mosquitto_sub reports nothing when it has subscribed: publish
			// until it has received one message and exited.
			tick := time.NewTicker(100 * time.Millisecond)
			defer tick.Stop()
			for {
				pub.pub(t, topic, 1, "to mosquitto_sub")
				select {
				case err := <-done:
					require.NoError(t, err, "mosquitto_sub: %s", out.String())
					require.Equal(t, "to mosquitto_sub\n", out.String())
					return
				case <-tick.C:
				}
			}
		})
		t.Run(version+"_retained", func(t *testing.T) {
			t.Parallel()
			topic := topicFor(t)
			run(t, "mosquitto_pub", "-V", version, "-q", "1", "-r", "-t", topic, "-m", "kept")
			out := run(t, "mosquitto_sub", "-V", version, "-q", "1", "-t", topic, "-C", "1", "-W", "5", "-v")
			require.Equal(t, topic+" kept\n", out)
			run(t, "mosquitto_pub", "-V", version, "-q", "1", "-r", "-t", topic, "-n") // delete it
			sub := connectV5(t, e.TCP, v5Connect("sub-"+uniq()))
			sub.sub(t, topic, 1)
			run(t, "mosquitto_pub", "-V", version, "-q", "1", "-t", topic, "-m", "marker")
			sub.expectPayloads(t, "marker")
		})
	}
}

// TestConformance_MQTT31 runs clients of MQTT 3.1 (protocol name "MQIsdp",
// level 3) against the edge beside 3.1.1 and 5 clients: QoS 0, 1 and 2 in
// both directions, a retained message, and a session kept across a
// reconnect with clean session off.
func TestConformance_MQTT31(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	topic := topicFor(t)
	v31 := func(id string) *mqtt.ClientOptions { return v3Options("tcp://"+e.TCP, id).SetProtocolVersion(3) }

	old := connectV3(t, v31("v31-"+uniq()))
	old.sub(t, topic+"/to-31/#", 2)
	v5 := connectV5(t, e.TCP, v5Connect("v5-"+uniq()))
	v5.sub(t, topic+"/to-5/#", 2)
	v311 := connectV3(t, v3Options("tcp://"+e.TCP, "v311-"+uniq()))
	for qos := byte(0); qos <= 2; qos++ {
		v5.pub(t, fmt.Sprintf("%s/to-31/q%d", topic, qos), qos, fmt.Sprintf("5 to 3.1 at %d", qos))
		m := old.next(t)
		require.Equal(t, fmt.Sprintf("5 to 3.1 at %d", qos), string(m.Payload()))
		require.Equal(t, qos, m.Qos())
		old.pub(t, fmt.Sprintf("%s/to-5/q%d", topic, qos), qos, false, fmt.Sprintf("3.1 to 5 at %d", qos))
		v5.expectPayloads(t, fmt.Sprintf("3.1 to 5 at %d", qos))
		v311.pub(t, fmt.Sprintf("%s/to-31/from-311-q%d", topic, qos), qos, false, "from 3.1.1")
		require.Equal(t, "from 3.1.1", string(old.next(t).Payload()))
	}

	old.pub(t, topic+"/kept", 1, true, "retained by 3.1")
	late := connectV3(t, v31("late-"+uniq()))
	late.sub(t, topic+"/kept", 1)
	m := late.next(t)
	require.Equal(t, "retained by 3.1", string(m.Payload()))
	require.True(t, m.Retained(), "[MQTT-3.3.1-8]")

	// Clean session off: the subscription and what arrived meanwhile wait.
	id := "v31-persist-" + uniq()
	p := connectV3(t, v31(id).SetCleanSession(false))
	p.sub(t, topic+"/away", 1)
	p.Disconnect(50)
	v5.pub(t, topic+"/away", 1, "while away")
	back := connectV3(t, v31(id).SetCleanSession(false))
	require.Equal(t, "while away", string(back.next(t).Payload()))
}

// TestConformance_WSS runs MQTT 3.1.1 and 5 over secure WebSocket (TLS,
// path /mqtt, subprotocol "mqtt") against the TCP listener.
func TestConformance_WSS(t *testing.T) {
	t.Parallel()
	skipIfExternal(t, "a WSS listener with a test certificate")
	certPath, keyPath, cert := selfSignedCert(t)
	wss := freeAddr(t)
	e := startEdge(t, "--tls.cert", certPath, "--tls.key", keyPath, "--mqtt.wss-addr", wss)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	tlsCfg := &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
	topic := topicFor(t)

	old := connectV3(t, v3Options("wss://"+wss+"/mqtt", "wss3-"+uniq()).SetTLSConfig(tlsCfg))
	old.sub(t, topic, 1)
	conn, resp, err := (&websocket.Dialer{Subprotocols: []string{"mqtt"}, HandshakeTimeout: 5 * time.Second, TLSClientConfig: tlsCfg}).
		Dial("wss://"+wss+"/mqtt", nil)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, "mqtt", conn.Subprotocol()) // [MQTT-6.0.0-4]
	v5, err := startV5(t, &wsConn{ws: conn}, v5Connect("wss5-"+uniq()))
	require.NoError(t, err)
	v5.sub(t, topic, 1)
	tcp := connectV5(t, e.TCP, v5Connect("tcp-"+uniq()))
	tcp.pub(t, topic, 1, "over wss")
	old.expectPayloads(t, "over wss")
	v5.expectPayloads(t, "over wss")
	v5.pub(t, topic, 2, "from wss")
	old.expectPayloads(t, "from wss")

	_, _, err = (&websocket.Dialer{Subprotocols: []string{"mqtt"}, HandshakeTimeout: 5 * time.Second,
		TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12}}).Dial("wss://"+wss+"/mqtt", nil)
	require.Error(t, err, "an untrusted certificate must fail verification")
}
