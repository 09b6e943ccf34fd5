package broker

import (
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// An edge that rejoins under a new incarnation drops the sessions of the
// lapsed one (DropLapsedSessions): their new holders read them, wills
// included, from the shared store, and publish the wills. A connection of
// such a session that ends while the sessions are dropped (the fence
// closed every connection, and one's end is late) must not leave a will
// scheduled here: it would go out from this edge after its delay as well
// as from the session's new holder, or after the client came back
// elsewhere and voided it there [MQTT-3.1.3-9].
func TestBroker_LapsedSessionsLeaveNoWillScheduled(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
	addr := serveTCP(t, b)
	const client = "lapsed"
	id := b.mustScope(t, "default").ClientID(client)
	old := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 1)
	waitBound(t, b, id)
	release := endHeldAtWill(t, b, id, old)

	pending := func() bool {
		b.willMu.Lock()
		defer b.willMu.Unlock()
		return b.wills[id] != nil
	}
	lapse := func(at string) {
		if at != id {
			return
		}
		// The connection's end comes to its will now; a will it
		// schedules shows within the wait.
		release()
		deadline := time.Now().Add(500 * time.Millisecond)
		for !pending() && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
	b.atLapse.Store(&lapse)
	require.Equal(t, 1, b.DropLapsedSessions())
	require.Nil(t, b.session(id), "the lapsed session is dropped")
	require.False(t, pending(), "no will of a lapsed session waits here")

	// Served again: nothing of the lapsed session goes out from here.
	watcher := willWatcher(t, addr, "gone/"+client)
	pk, err := watcher.Read(2 * time.Second)
	require.Error(t, err, "a lapsed session's will went out from this edge: type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
}

// willWatcher is a client of addr subscribed at QoS 1 to topic, the will
// topic a test's client leaves.
func willWatcher(t *testing.T, addr, topic string) *mqtttest.Client {
	t.Helper()
	w := mqtttest.Dial(t, addr, 5)
	w.Connect("watcher", true, packets.Properties{})
	require.Equal(t, []byte{1}, w.Subscribe(1, topic, 1).ReasonCodes)
	return w
}
