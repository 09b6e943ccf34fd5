package broker

import (
	"fmt"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A copy given up because a write of it was fenced (a newer claim holds
// the session: its client connected elsewhere, or a custodian took it)
// leaves the session's will to that holder: the will of its last
// connection, waiting for its delay here, must not go out from this edge
// too, or after the client came back there [MQTT-3.1.3-9]. Once the copy
// is gone nothing else here would cancel it.
func TestBroker_FencedCopyLeavesNoWillWaiting(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
	addr := serveTCP(t, b)
	const client = "fenced"
	id := b.mustScope(t, "default").ClientID(client)
	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("watcher", true, packets.Properties{})
	require.Equal(t, []byte{1}, watcher.Subscribe(1, "gone/"+client, 1).ReasonCodes)
	const delay = 2
	old := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, delay)
	waitBound(t, b, id)
	_ = old.Conn.Close()
	require.Eventually(t, func() bool {
		b.willMu.Lock()
		defer b.willMu.Unlock()
		return b.wills[id] != nil
	}, 5*time.Second, time.Millisecond, "the will waits for its delay")

	require.True(t, b.yieldIfFenced(b.session(id), fmt.Errorf("queue: %w", durable.ErrFenced)))
	require.Eventually(t, func() bool { return b.session(id) == nil }, 5*time.Second, time.Millisecond, "the copy is given up")

	pk, err := watcher.Read((delay + 1) * time.Second)
	require.Error(t, err, "the will of a session given up to a newer holder went out from here: type %d, payload %q",
		pk.FixedHeader.Type, pk.Payload)
}
