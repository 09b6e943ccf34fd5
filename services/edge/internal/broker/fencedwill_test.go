package broker

import (
	"context"
	"fmt"
	"sync"
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
	watcher := willWatcher(t, addr, "gone/"+client)
	const delay = 2
	old := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, delay)
	waitBound(t, b, id)
	_ = old.Conn.Close()
	waitWillWaiting(t, b, id)

	require.True(t, b.yieldIfFenced(b.session(id), fmt.Errorf("queue: %w", durable.ErrFenced)))
	require.Eventually(t, func() bool { return b.session(id) == nil }, 5*time.Second, time.Millisecond, "the copy is given up")

	pk, err := watcher.Read((delay + 1) * time.Second)
	require.Error(t, err, "the will of a session given up to a newer holder went out from here: type %d, payload %q",
		pk.FixedHeader.Type, pk.Payload)
}

// routesHeldAtRemove holds the first route removal until release.
type routesHeldAtRemove struct {
	fakeRoutes
	entered chan struct{}
	release chan struct{}
}

func (r *routesHeldAtRemove) Remove(ctx context.Context, a, b, c string) error {
	select {
	case r.entered <- struct{}{}:
		<-r.release
	default:
	}
	return nil
}

// A copy given up for a newer holder cancels only the will its own
// connection left. Its routes' removal can take a while, and meanwhile the
// client may come back here, resumed from the store, and its new
// connection end with a will waiting for its delay: that will is the new
// copy's, and goes out.
func TestBroker_GivenUpCopyLeavesANewerConnectionsWill(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
	addr := serveTCP(t, b)
	routes := &routesHeldAtRemove{fakeRoutes: fakeRoutes{add: func(string, string, string) error { return nil }},
		entered: make(chan struct{}, 1), release: make(chan struct{})}
	b.SetCluster(Cluster{Routes: routes})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(routes.release) }) })
	const client = "fenced2"
	id := b.mustScope(t, "default").ClientID(client)
	watcher := willWatcher(t, addr, "gone/"+client)
	old := connectWithWill(t, addr, 5, client, "gone/"+client, false, persistentSession, 60)
	waitBound(t, b, id)
	require.Equal(t, []byte{1}, old.Subscribe(1, "some/topic", 1).ReasonCodes)
	_ = old.Conn.Close()
	waitWillWaiting(t, b, id)
	require.True(t, b.yieldIfFenced(b.session(id), fmt.Errorf("queue: %w", durable.ErrFenced)))
	select {
	case <-routes.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("route removal not reached")
	}
	require.Nil(t, b.session(id))
	// The client comes back here meanwhile (resumed from the store), and its
	// connection drops: its will waits for its 1 s delay.
	neu := mqtttest.Dial(t, addr, 5)
	neu.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: persistentSession,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Keepalive: 30, ClientIdentifier: client,
			WillFlag: true, WillTopic: "gone/" + client, WillQos: 1, WillPayload: []byte("neu"),
			WillProperties: packets.Properties{WillDelayInterval: 1}}})
	require.Equal(t, packets.CodeSuccess.Code, neu.Expect(packets.Connack).ReasonCode)
	waitBound(t, b, id)
	_ = neu.Conn.Close()
	waitWillWaiting(t, b, id) // the new connection's
	once.Do(func() { close(routes.release) })
	pk, err := watcher.Read(4 * time.Second)
	require.NoError(t, err, "the newer connection's will was cancelled by the old copy's forget: lost")
	require.Equal(t, packets.Publish, pk.FixedHeader.Type)
	require.Equal(t, []byte("neu"), pk.Payload, "the newer connection's will")
}
