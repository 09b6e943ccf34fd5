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

// storedThenHeld stores the n-th PutSession (counted from 1), then holds it
// until release: the CONNECT that stored its session waits before mochi's
// inheritClientSession.
type storedThenHeld struct {
	*durable.Store
	n       int
	calls   atomic.Int32
	entered chan struct{}
	release chan struct{}
	open    func()
}

func (g *storedThenHeld) PutSession(ctx context.Context, rec durable.Session) error {
	err := g.Store.PutSession(ctx, rec)
	if int(g.calls.Add(1)) == g.n {
		close(g.entered)
		<-g.release
	}
	return err
}

// brokerHoldingSecondStore is a broker on a durable store whose second
// PutSession is held (storedThenHeld) until the gate opens (at cleanup at
// the latest), with single-node ownership that logs its releases.
func brokerHoldingSecondStore(t *testing.T) (*Broker, *durable.Store, *storedThenHeld, *releaseCounter, string) {
	t.Helper()
	gate := &storedThenHeld{n: 2, entered: make(chan struct{}), release: make(chan struct{})}
	gate.open = sync.OnceFunc(func() { close(gate.release) })
	b, st := brokerOnStore(t, func(s *durable.Store) DurableState { gate.Store = s; return gate })
	t.Cleanup(gate.open)
	own := &releaseCounter{Ownership: &localOwnership{}}
	b.SetCluster(Cluster{Ownership: own})
	return b, st, gate, own, serveTCP(t, b)
}

// A CONNECT that found the session not expired (OnSessionEstablish) resumes
// it: mochi's expiry tick coming before mochi's inheritClientSession must
// not end it under the new connection. It did: the tick's expireOffline
// ended the edge's copy (the new connection not bound yet), deleted the
// record the CONNECT had just stored and released the claim under the new
// connection's epoch (s.claimed had raised it), so the coordinator forgot
// the owner of a live connection (invariant 3) and a restart lost the
// session (invariant 1).
func TestBroker_ExpiryTickDuringConnectDoesNotEndTheResumedSession(t *testing.T) {
	t.Parallel()
	b, st, gate, own, addr := brokerHoldingSecondStore(t)
	id := b.mustScope(t, "default").ClientID("tick")

	c := mqtttest.Dial(t, addr, 5)
	c.Connect("tick", false, packets.Properties{SessionExpiryInterval: 1, SessionExpiryIntervalFlag: true})
	c.Subscribe(1, "tick/#", 1)
	s := b.session(id)
	require.NotNil(t, s)
	_ = c.Conn.Close()
	waitUnbound(t, s)

	again := mqtttest.Dial(t, addr, 5)
	acks := make(chan packets.Packet, 1)
	go func() {
		acks <- again.Connect("tick", false, packets.Properties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true})
	}()
	<-gate.entered                      // not expired at the CONNECT; its session stored
	time.Sleep(2200 * time.Millisecond) // the 1 s expiry passes; mochi's tick comes
	gate.open()
	ack := <-acks
	epoch := waitBound(t, b, id)

	_, ok, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok, "the resumed session's record is stored")
	time.Sleep(200 * time.Millisecond)
	own.mu.Lock()
	released := slices.Clone(own.released)
	own.mu.Unlock()
	require.NotContains(t, released, epoch, "the live connection's claim is not released")
	require.NoError(t, b.Publish("default", "tick/a", []byte("p"), 1, false))
	require.Equal(t, []byte("p"), again.Expect(packets.Publish).Payload, "the session's subscription stays")
	require.True(t, ack.SessionPresent, "the session had not expired when the CONNECT came")
}
