package conformance

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// TestConformance_KeepAlive checks keep-alive enforcement: a client silent
// for one and a half times its Keep Alive is disconnected, and one that
// sends PINGREQ in time is not.
func TestConformance_KeepAlive(t *testing.T) {
	t.Parallel()
	e := startEdge(t)
	t.Run("silent_client_closed", func(t *testing.T) {
		t.Parallel()
		cp := rawConnect("ka-" + uniq())
		cp.KeepAlive = 1
		rc, _ := connectRaw(t, e.TCP, cp)
		d, took := rc.expectClosed(t, 4*time.Second)
		// [MQTT-3.1.2-22]: closed once nothing arrived for 1.5 × Keep Alive,
		// and not before (a client may send its PINGREQ at Keep Alive and the
		// half is the allowance for it to arrive).
		require.GreaterOrEqual(t, took, 1400*time.Millisecond, "closed before 1.5 × Keep Alive")
		require.LessOrEqual(t, took, 2500*time.Millisecond, "not closed after 1.5 × Keep Alive")
		requireReason(t, e, d, 0x8d) // Keep Alive timeout
	})
	t.Run("pinging_client_kept", func(t *testing.T) {
		t.Parallel()
		cp := rawConnect("ka-" + uniq())
		cp.KeepAlive = 1
		rc, _ := connectRaw(t, e.TCP, cp)
		for range 5 { // 2.5 s in all, well past 1.5 × Keep Alive
			time.Sleep(500 * time.Millisecond)
			rc.send(t, &packets.Pingreq{})
			rc.expect(t, packets.PINGRESP) // [MQTT-3.12.4-1]
		}
	})
	t.Run("mqtt311_silent_client_closed", func(t *testing.T) {
		t.Parallel()
		rc, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "ka-" + uniq(), keepAlive: 1})
		require.Equal(t, byte(0), code)
		_, took := rc.expectClosed(t, 4*time.Second)
		require.GreaterOrEqual(t, took, 1400*time.Millisecond, "closed before 1.5 × Keep Alive")
	})
}

// TestConformance_ServerKeepAlive starts an edge that caps keep-alive at one
// second and checks that CONNACK carries Server Keep Alive for larger and
// zero requests, and that the server enforces the value it sent.
func TestConformance_ServerKeepAlive(t *testing.T) {
	t.Parallel()
	e := startEdge(t, "--mqtt.max-keepalive", "1")
	for _, requested := range []uint16{60, 0} {
		t.Run(fmt.Sprintf("requested_%d", requested), func(t *testing.T) {
			t.Parallel()
			cp := rawConnect("ska-" + uniq())
			cp.KeepAlive = requested
			rc, ca := connectRaw(t, e.TCP, cp)
			// §3.2.2.3.14, [MQTT-3.2.2-21]: the client must use the Server
			// Keep Alive sent in CONNACK...
			require.NotNil(t, ca.Properties.ServerKeepAlive, "Server Keep Alive")
			require.Equal(t, uint16(1), *ca.Properties.ServerKeepAlive)
			// ...and the server enforces it ([MQTT-3.1.2-22]).
			_, took := rc.expectClosed(t, 4*time.Second)
			require.LessOrEqual(t, took, 2500*time.Millisecond)
		})
	}
	t.Run("paho_client_kept", func(t *testing.T) {
		t.Parallel()
		// paho.golang pings every Server Keep Alive seconds when idle, as
		// [MQTT-3.1.2-20] asks; the server must allow 1.5 times that.
		cp := v5Connect("paho-" + uniq())
		cp.KeepAlive = 60
		c := connectV5(t, e.TCP, cp)
		select {
		case <-c.Done():
			t.Fatal("a client pinging at the Server Keep Alive was disconnected")
		case <-time.After(2500 * time.Millisecond):
		}
	})
}

// TestConformance_ConnectTimeout checks that a connection that sends no
// CONNECT is closed after --mqtt.connect-timeout, and that the timeout no
// longer applies once CONNECT has arrived.
func TestConformance_ConnectTimeout(t *testing.T) {
	t.Parallel()
	e := startEdge(t, "--mqtt.connect-timeout", "500ms")
	t.Run("silent", func(t *testing.T) {
		t.Parallel()
		rc := dialRaw(t, e.TCP)
		_, took := rc.expectClosed(t, 3*time.Second)
		require.GreaterOrEqual(t, took, 400*time.Millisecond)
	})
	t.Run("partial_connect", func(t *testing.T) {
		t.Parallel()
		rc := dialRaw(t, e.TCP)
		rc.sendBytes(t, rawConnectBytes(t)[:5])
		rc.expectClosed(t, 3*time.Second)
	})
	t.Run("connected_client_unaffected", func(t *testing.T) {
		t.Parallel()
		for _, ka := range []uint16{30, 0} {
			cp := rawConnect("ct-" + uniq())
			cp.KeepAlive = ka
			rc, _ := connectRaw(t, e.TCP, cp)
			time.Sleep(800 * time.Millisecond) // past the connect timeout
			rc.expectOpen(t)
		}
	})
}

// v311Connect is an MQTT 3.1.1 CONNECT for clientID with clean session and
// a 30 s keep alive.
func v311Connect(clientID string) []byte {
	body := append([]byte{0, 4, 'M', 'Q', 'T', 'T', 4, 0x02, 0, 30, byte(len(clientID) >> 8), byte(len(clientID))}, clientID...)
	return append([]byte{0x10, byte(len(body))}, body...)
}

func rawConnectBytes(t *testing.T) []byte {
	t.Helper()
	var b bytes.Buffer
	_, err := rawConnect("partial").WriteTo(&b)
	require.NoError(t, err)
	return b.Bytes()
}

// TestConformance_MaxConnections starts an edge that admits two connections
// and checks that a third is refused with a CONNACK error and closed, and
// that a slot frees when a client leaves.
func TestConformance_MaxConnections(t *testing.T) {
	t.Parallel()
	e := startEdge(t, "--mqtt.max-connections", "2")
	c1 := connectV5(t, e.TCP, v5Connect("mc1-"+uniq()))
	connectV5(t, e.TCP, v5Connect("mc2-"+uniq()))

	rc := dialRaw(t, e.TCP)
	rc.send(t, rawConnect("mc3-"+uniq()))
	ca := rc.expect(t, packets.CONNACK).Content.(*packets.Connack)
	// §3.2.2.2: 0x89 Server busy or 0x97 Quota exceeded.
	require.Contains(t, []byte{0x89, 0x97}, ca.ReasonCode, "CONNACK reason 0x%02x", ca.ReasonCode)
	require.False(t, ca.SessionPresent, "[MQTT-3.2.2-6]")
	rc.expectClosed(t, waitMsg) // [MQTT-3.2.2-7]

	rc3, code := connectV311Raw(t, e.TCP, v311Conn{clientID: "mc3-" + uniq(), keepAlive: 30})
	require.Equal(t, byte(3), code, "3.1.1 return code 3: server unavailable")
	rc3.expectClosed(t, waitMsg)

	require.NoError(t, c1.Disconnect(&paho.Disconnect{}))
	eventually(t, waitMsg, func() error {
		c, err := dialV5(t, e.TCP, v5Connect("mc4-"+uniq()))
		if err != nil {
			return err
		}
		_ = c.Disconnect(&paho.Disconnect{})
		return nil
	})
}

// TestConformance_MaxSubscriptions starts an edge that allows two
// subscriptions per session and checks that SUBACK refuses the third, that
// replacing an existing subscription is not refused, and that every granted
// subscription delivers.
func TestConformance_MaxSubscriptions(t *testing.T) {
	t.Parallel()
	e := startEdge(t, "--mqtt.max-subscriptions", "2")
	base := topicFor(t)
	c := connectV5(t, e.TCP, v5Connect("ms-"+uniq()))
	sa, err := c.trySubscribe(&paho.Subscribe{Subscriptions: []paho.SubscribeOptions{
		{Topic: base + "/a", QoS: 1}, {Topic: base + "/b", QoS: 1}, {Topic: base + "/c", QoS: 1},
	}})
	require.NoError(t, err)
	require.Len(t, sa.Reasons, 3)
	require.Less(t, sa.Reasons[0], byte(0x80))
	require.Less(t, sa.Reasons[1], byte(0x80))
	// §3.9.3: 0x97 Quota exceeded. A SUBACK that grants the filter promises
	// delivery ([MQTT-3.8.4-6]), which the check below holds it to.
	require.Equal(t, byte(0x97), sa.Reasons[2], "SUBACK for the subscription over the limit")
	c.sub(t, base+"/a", 0) // replacing an existing subscription is no new one

	pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
	for _, s := range []string{"a", "b", "c"} {
		pub.pub(t, base+"/"+s, 1, s)
	}
	pub.pub(t, base+"/a", 1, "end")
	c.expectPayloads(t, "a", "b", "end")
}

// TestConformance_ServerShutdown stops the edge with SIGTERM and checks that
// MQTT 5 clients get DISCONNECT 0x8B (Server shutting down), that MQTT
// 3.1.1 clients see their connection closed with no DISCONNECT (3.1.1
// defines none from the server, §3.14), and that the process exits 0.
func TestConformance_ServerShutdown(t *testing.T) {
	t.Parallel()
	skipIfExternal(t, "the test stops the broker")
	e := startEdge(t)
	c := connectV5(t, e.TCP, v5Connect("sd-"+uniq()))
	old := connectV3(t, v3Options("tcp://"+e.TCP, "sd3-"+uniq()))
	raw3 := dialRaw(t, e.TCP)
	raw3.sendBytes(t, v311Connect("sd3raw-"+uniq()))
	ca, err := raw3.readFrame(waitMsg)
	require.NoError(t, err)
	require.Equal(t, []byte{0x20, 0x02, 0x00, 0x00}, ca, "3.1.1 CONNACK, accepted")
	e.stop(t)
	require.Equal(t, byte(0x8b), c.expectDisconnect(t).ReasonCode, "§3.14.2.1 Server shutting down")
	select {
	case <-old.lost:
	case <-time.After(waitMsg):
		t.Fatal("the MQTT 3.1.1 connection stayed open")
	}
	if f, err := raw3.readFrame(waitMsg); err == nil {
		t.Fatalf("the MQTT 3.1.1 client was sent % x at shutdown; want the connection closed, no packet", f)
	} else if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal("the MQTT 3.1.1 connection stayed open")
	}
	_, err = dialV5(t, e.TCP, v5Connect("late-"+uniq()))
	require.Error(t, err, "the listener is closed")
}
