package broker

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// deleteHeld is a shared store whose first DeleteSession after armed is
// held until release.
type deleteHeld struct {
	sharedLocal
	armed   atomic.Bool
	once    sync.Once
	entered chan struct{}
	release chan struct{}
}

func (g *deleteHeld) DeleteSession(ctx context.Context, id string, wait bool) error {
	if g.armed.Load() {
		held := false
		g.once.Do(func() { held = true })
		if held {
			close(g.entered)
			<-g.release
		}
	}
	return g.sharedLocal.DeleteSession(ctx, id, wait)
}

// A 3.1.1 clean session ends with its connection [MQTT-3.1.2-6]. A CONNECT
// without Clean Session that comes while the closed connection's
// OnDisconnect is between its unbind and its endSession (here: publishing
// its will, which takes the will out of the stored record) found no live
// connection in takeOver, so it "resumed" the session: takeOver raised the
// session's epoch to the new claim's and told mochi SessionResumed, which
// overrides mochi's own rule (existing 3.1.1 clean → fresh). Then either
// mochi inherits the ended session's subscriptions (Session Present 1), or
// the old connection's endSession ends the copy under the NEW claim's epoch
// and releases it (invariant 3).
func TestBroker_TakeoverOfAClosingCleanSessionEndsIt(t *testing.T) {
	t.Parallel()
	gate := &deleteHeld{entered: make(chan struct{}), release: make(chan struct{})}
	open := sync.OnceFunc(func() { close(gate.release) })
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { gate.Store = s; return gate })
	t.Cleanup(open)
	own := &releaseCounter{Ownership: &localOwnership{}}
	b.SetCluster(Cluster{Ownership: own})
	addr := serveTCP(t, b)
	id := b.mustScope(t, "default").ClientID("closing")

	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("watch-closing", true, packets.Properties{})
	require.Equal(t, []byte{1}, watcher.Subscribe(1, "gone/closing", 1).ReasonCodes)

	old := connectWithWill(t, addr, 4, "closing", "gone/closing", true, packets.Properties{}, 0)
	require.Equal(t, []byte{1}, old.Subscribe(1, "data/closing", 1).ReasonCodes)
	waitBound(t, b, id)
	gate.armed.Store(true)
	_ = old.Conn.Close() // its will goes out; the record's will is dropped (held)
	select {
	case <-gate.entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the old connection's will was not dropped from its record")
	}

	newer := mqtttest.Dial(t, addr, 4)
	acks := make(chan packets.Packet, 1)
	go func() { acks <- newer.Connect("closing", false, packets.Properties{}) }()
	var ack packets.Packet
	select {
	case ack = <-acks:
		open()
	case <-time.After(3 * time.Second):
		open()
		ack = <-acks
	}
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	epoch := waitBound(t, b, id)
	time.Sleep(300 * time.Millisecond)
	s := b.session(id)
	require.NotNil(t, s, "the new connection's session is held")
	s.mu.Lock()
	bound := s.client != nil
	s.mu.Unlock()
	require.True(t, bound, "the new connection is bound")
	own.mu.Lock()
	released := slices.Clone(own.released)
	own.mu.Unlock()
	require.NotContains(t, released, epoch, "the new connection's claim is not released")
	require.Zero(t, s.nsubs.Load(), "nothing of the ended session's subscriptions")
	require.False(t, ack.SessionPresent, "the clean session ended with its connection [MQTT-3.1.2-6]")
}
