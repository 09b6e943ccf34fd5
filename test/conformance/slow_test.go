package conformance

import (
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
	"github.com/stretchr/testify/require"
)

// TestConformance_SlowConsumer subscribes a fast client and a slow one to the
// same topic on an edge with an 8-message client queue and a 300 ms
// slow-consumer grace. The slow client either stops acknowledging (Receive
// Maximum 1, no PUBACK) or stops reading its socket altogether, and its
// session is either non-persistent or persistent. In every case the
// publisher's QoS 1 messages are all acknowledged, the fast subscriber gets
// all of them in order without waiting much longer than the grace, and a
// persistent slow subscriber gets every acknowledged message when it
// reconnects (§4.3.2: QoS 1 is delivered at least once; [MQTT-3.1.2-23]:
// the session state, with its pending messages, outlives the connection).
func TestConformance_SlowConsumer(t *testing.T) {
	t.Parallel()
	const grace = 300 * time.Millisecond
	e := startEdge(t, "--mqtt.queue-len", "8", "--mqtt.queue-bytes", "262144", "--mqtt.slow-consumer-grace", grace.String())

	for _, tc := range []struct {
		name         string
		stopsReading bool // else: reads, but never acknowledges
		persistent   bool
		n, size      int // messages and payload bytes
	}{
		{name: "stops_acking", n: 50, size: 16},
		{name: "stops_acking_persistent", persistent: true, n: 50, size: 16},
		// Enough bytes to fill the loopback socket buffers (4 MiB at most
		// here) past a 4 KiB receive buffer, so the edge's writes block.
		{name: "stops_reading", stopsReading: true, n: 200, size: 32 << 10},
		{name: "stops_reading_persistent", stopsReading: true, persistent: true, n: 200, size: 32 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			topic, slowID := topicFor(t), "slow-"+uniq()
			fast := connectV5(t, e.TCP, v5Connect("fast-"+uniq()))
			fast.sub(t, topic, 1)

			cp := rawConnect(slowID)
			if tc.persistent {
				cp.Properties.SessionExpiryInterval = u32(300)
			}
			if !tc.stopsReading {
				cp.Properties.ReceiveMaximum = u16(1)
			}
			slow := dialRawSmallBuffer(t, e.TCP)
			slow.send(t, cp)
			slow.expect(t, packets.CONNACK)
			slow.send(t, &packets.Subscribe{PacketID: 1, Properties: &packets.Properties{},
				Subscriptions: []packets.SubOptions{{Topic: topic, QoS: 1}}})
			slow.expect(t, packets.SUBACK)
			// From here the slow client never acknowledges and, if it stops
			// reading, never reads.

			pub := connectV5(t, e.TCP, v5Connect("pub-"+uniq()))
			want := make([]string, tc.n)
			for i := range want {
				want[i] = fmt.Sprintf("%06d", i) + strings.Repeat("x", tc.size-6)
			}
			start := time.Now()
			for _, p := range want {
				pub.pub(t, topic, 1, p) // fails unless PUBACK < 0x80 within waitMsg
			}
			for i := range want {
				m := fast.next(t)
				require.Equal(t, want[i][:6], string(m.Payload[:6]), "fast subscriber: message %d", i)
			}
			took := time.Since(start)
			t.Logf("%d messages published and delivered to the fast subscriber in %v", tc.n, took)
			// A consumer that held the others back would stall the
			// publisher until its grace ran out, for every message. The
			// bound leaves room for the work itself: for a persistent slow
			// consumer every message is stored in its queue before the
			// PUBACK, 200 × 32 KiB of writes that took 2.2–3.8 s with the
			// race detector on 2 cores beside the other subtests.
			bound := grace + 3*time.Second
			if tc.persistent {
				bound = grace + 6*time.Second
			}
			require.Less(t, took, bound, "the slow consumer held the others back")

			if !tc.stopsReading && !tc.persistent {
				// keel-edge disconnects a non-persistent consumer that stays
				// full past the grace, with 0x97 (--mqtt.slow-consumer-grace).
				d, _ := slow.expectClosed(t, waitMsg)
				requireReason(t, e, d, 0x97) // quota exceeded
			}
			if !tc.persistent {
				return
			}
			require.NoError(t, slow.conn.Close())
			re := v5Connect(slowID)
			re.CleanStart = false
			re.Properties.SessionExpiryInterval = u32(300)
			back := connectV5(t, e.TCP, re)
			require.True(t, back.Connack.SessionPresent)
			// Every acknowledged message arrives at least once (the ones in
			// flight when the connection died come again, DUP set). The order
			// of re-sent messages is checked by TestConformance_Session.
			seen := map[string]bool{}
			deadline := time.After(2 * waitMsg)
			for len(seen) < tc.n {
				select {
				case m := <-back.msgs:
					seen[string(m.Payload[:6])] = true
				case <-deadline:
					t.Fatalf("persistent slow consumer got %d of %d acknowledged messages after reconnecting", len(seen), tc.n)
				}
			}
			back.expectNothing(t, quiet)
			_ = back.Disconnect(&paho.Disconnect{})
		})
	}
}

// dialRawSmallBuffer dials a raw client whose socket receive buffer is as
// small as the kernel allows, so that a client that stops reading soon
// pushes back on the server.
func dialRawSmallBuffer(t *testing.T, addr string) *rawClient {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		})
		if err != nil {
			return err
		}
		return serr
	}}
	conn, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return newRawClient(conn)
}
