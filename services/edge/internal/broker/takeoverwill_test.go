package broker

import (
	"sync"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// holdAtWill holds the end of the connection of the internal client ID id
// as it comes to its will (OnDisconnect), once. It returns a channel closed
// when the end is held, and the func that lets it go on.
func holdAtWill(t *testing.T, b *Broker, id string) (held <-chan struct{}, release func()) {
	t.Helper()
	in, out := make(chan struct{}), make(chan struct{})
	var once sync.Once
	hold := func(cl *mqtt.Client) {
		if cl.ID == id {
			once.Do(func() { close(in); <-out })
		}
	}
	b.atWill.Store(&hold)
	release = sync.OnceFunc(func() { close(out) })
	t.Cleanup(release)
	return in, release
}

// endHeldAtWill closes old, a connection of the internal client ID id, and
// returns once its end is held at its will (holdAtWill), with the func
// that lets the end go on.
func endHeldAtWill(t *testing.T, b *Broker, id string, old *mqtttest.Client) (release func()) {
	t.Helper()
	held, release := holdAtWill(t, b, id)
	_ = old.Conn.Close()
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the connection's end did not come to its will")
	}
	return release
}

// A connection that ends on its own while a newer connection of its client
// takes its session over comes to its will after the takeover decided what
// becomes of the session, whichever of the two the takeover found first.
// When the session goes on (a CONNECT without Clean Start here, or a move
// to the edge that claimed it), the will is never published, its delay
// notwithstanding: a new connection to the session came before the delay
// passed [MQTT-3.1.3-9]. When the session ends (Clean Start, or a session
// that does not outlive its connection taken by another edge), the will
// goes out at once, not after its delay: it is published when the delay
// passes or the session ends, whichever is first. Either way the old
// connection ended before the takeover could void or hasten its will
// through the connection itself.
func TestBroker_WillOfAConnectionEndingDuringATakeover_MQTT_3_1_3_9(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		elsewhere bool               // taken by another edge (TakeOver), not by a CONNECT here
		clean     bool               // the taking connection's Clean Start
		props     packets.Properties // the old connection's
		delay     uint32             // its will's
		hold      bool               // its end held at its will until the takeover is done
		will      bool               // published, at once
	}{
		{name: "resumed_here", props: persistentSession, delay: 1, hold: true},
		{name: "clean_start_here", clean: true, props: persistentSession, delay: 60, hold: true, will: true},
		{name: "moved_elsewhere", elsewhere: true, props: persistentSession, delay: 1, hold: true},
		{name: "clean_start_elsewhere", elsewhere: true, clean: true, props: persistentSession, delay: 60, hold: true, will: true},
		{name: "expiry_0_taken_elsewhere", elsewhere: true, delay: 60, will: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { return s })
			addr := serveTCP(t, b)
			const client = "ending"
			id := b.mustScope(t, "default").ClientID(client)
			watcher := willWatcher(t, addr, "gone/"+client)

			old := connectWithWill(t, addr, 5, client, "gone/"+client, true, tc.props, tc.delay)
			epoch := waitBound(t, b, id)
			release := func() {}
			if tc.hold {
				release = endHeldAtWill(t, b, id, old)
			}
			if tc.elsewhere {
				owned, _, _, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, tc.clean)
				require.NoError(t, err)
				require.True(t, owned)
			} else {
				ack := mqtttest.Dial(t, addr, 5).Connect(client, tc.clean, persistentSession)
				require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
				require.Equal(t, !tc.clean, ack.SessionPresent)
			}
			release()
			if !tc.will {
				pk, err := watcher.Read(time.Duration(tc.delay)*time.Second + 1500*time.Millisecond)
				require.Error(t, err, "the session went on, yet its old connection's will came: type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
				return
			}
			ended := time.Now()
			pk, err := watcher.Read(5 * time.Second)
			require.NoError(t, err, "the session ended: its old connection's will goes out at once")
			require.Equal(t, packets.Publish, pk.FixedHeader.Type)
			require.Equal(t, client, string(pk.Payload))
			require.Less(t, time.Since(ended), 2*time.Second)
			watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			pk, err = watcher.Read(time.Second)
			require.Error(t, err, "the will is published once; got type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
		})
	}
}
