package broker

import (
	"bytes"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// pauseAfterConnect holds the next CONNECT, once armed, after the edge's
// own OnConnect hook (its claim) and before mochi establishes it.
type pauseAfterConnect struct {
	mqtt.HookBase
	armed   atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (h *pauseAfterConnect) ID() string           { return "pause" }
func (h *pauseAfterConnect) Provides(b byte) bool { return b == mqtt.OnConnect }
func (h *pauseAfterConnect) OnConnect(cl *mqtt.Client, pk packets.Packet) error {
	if h.armed.CompareAndSwap(true, false) {
		close(h.entered)
		<-h.release
	}
	return nil
}

// A CONNECT whose claim came first is established first, also when a
// newer CONNECT of the client, claimed after it, reaches mochi's
// establishment before it: established last, the older connection took
// the session from the newer one, whose bind had come, and then could
// not bind it under its older claim, leaving it to neither.
func TestBroker_OlderClaimIsEstablishedFirst(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return st })
	p := &pauseAfterConnect{entered: make(chan struct{}), release: make(chan struct{})}
	require.NoError(t, b.server.AddHook(p, nil))
	open := sync.OnceFunc(func() { close(p.release) })
	t.Cleanup(open)
	addr := serveTCP(t, b)
	first := mqtttest.Dial(t, addr, 5)
	first.Connect("ro", false, persistentSession)
	first.Subscribe(1, "ro/x", 1)

	p.armed.Store(true)
	a := mqtttest.Dial(t, addr, 5)
	go a.Write(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, ProtocolVersion: 5,
		Connect:    packets.ConnectParams{ProtocolName: []byte("MQTT"), ClientIdentifier: "ro", Keepalive: 30},
		Properties: persistentSession})
	<-p.entered // A claimed (older epoch), paused before OnSessionEstablish
	bc := mqtttest.Dial(t, addr, 5)
	connected := make(chan struct{})
	go func() { defer close(connected); bc.Connect("ro", false, persistentSession) }() // B: the newer claim
	time.Sleep(300 * time.Millisecond)
	open()
	<-connected
	time.Sleep(500 * time.Millisecond)
	require.NoError(t, b.Publish("default", "ro/x", []byte("p"), 1, false))
	got := bc.Expect(packets.Publish).Payload
	require.True(t, bytes.Equal(got, []byte("p")), "the newest connection holds the session")
}
