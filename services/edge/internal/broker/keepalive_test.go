package broker

import (
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// deadlineConn records the deadlines set on it.
type deadlineConn struct {
	net.Conn
	read, write time.Time
	sets        int
}

func (c *deadlineConn) SetDeadline(t time.Time) error {
	c.read, c.write = t, t
	c.sets++
	return nil
}

func (c *deadlineConn) SetWriteDeadline(t time.Time) error { c.write = t; return nil }

// The keep-alive deadline always covers 1.5 × keep-alive from the last
// packet read, and at most slack more, while a busy connection moves it
// only now and then; a write deadline set on its own makes the next one
// be set again.
func TestKeepaliveConn_DeadlineCoversOneAndAHalfKeepAlives(t *testing.T) {
	raw := &deadlineConn{}
	kc := &keepaliveConn{Conn: raw}
	kc.setKeepalive(10)
	ka := 10 * time.Second
	slack := 250 * time.Millisecond
	start := time.Now()
	for i := range 1000 {
		readAt := start.Add(time.Duration(i) * time.Millisecond)
		// What mochi passes after a read at readAt: 10 + 5 whole seconds.
		require.NoError(t, kc.SetDeadline(readAt.Add(15*time.Second)))
		require.False(t, raw.read.Before(readAt.Add(ka+ka/2)), "read %d: deadline short of 1.5 × keep-alive", i)
		require.False(t, raw.read.After(readAt.Add(ka+ka/2+slack)), "read %d: deadline past the slack", i)
	}
	require.LessOrEqual(t, raw.sets, 5, "a second of packets moved the deadline %d times", raw.sets)

	sets := raw.sets
	require.NoError(t, kc.SetWriteDeadline(start.Add(time.Second)))
	require.NoError(t, kc.SetDeadline(start.Add(time.Second+15*time.Second)))
	require.Equal(t, sets+1, raw.sets, "set again after a write deadline of its own")
	require.True(t, raw.write.After(start.Add(16*time.Second)), "the write deadline is the keep-alive's again")

	require.NoError(t, kc.SetDeadline(time.Time{}))
	require.True(t, raw.read.IsZero(), "no deadline passes through")
}

// mochi's own rounding is undone: a 1 s keep-alive gets 1.5 s, not 1 s.
func TestKeepaliveConn_OneSecondGetsOneAndAHalf(t *testing.T) {
	raw := &deadlineConn{}
	kc := &keepaliveConn{Conn: raw}
	kc.setKeepalive(1)
	now := time.Now()
	require.NoError(t, kc.SetDeadline(now.Add(time.Second))) // mochi: 1 + 1/2 = 1 whole second
	require.False(t, raw.read.Before(now.Add(1500*time.Millisecond)))
	require.False(t, raw.read.After(now.Add(1550*time.Millisecond)))
}
