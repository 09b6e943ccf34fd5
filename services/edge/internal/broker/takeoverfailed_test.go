package broker

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// loadFails is a shared store whose LoadSession fails while fail is set,
// having run during first, when set.
type loadFails struct {
	sharedLocal
	fail   *atomic.Bool
	during *func()
}

func (s loadFails) LoadSession(ctx context.Context, id string) (durable.SessionState, bool, error) {
	if s.fail.Load() {
		if s.during != nil && *s.during != nil {
			(*s.during)()
		}
		return durable.SessionState{}, false, errors.New("store unavailable")
	}
	return s.sharedLocal.LoadSession(ctx, id)
}

// waitParked waits until a connection's end has left its will with the
// move of s.
func waitParked(t *testing.T, s *session) {
	t.Helper()
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.moving != nil && len(s.moving.wills) > 0
	}, 5*time.Second, 5*time.Millisecond, "the ending connection did not leave its will with the move")
}

// A takeover that fails at this edge, its session's stored state not
// readable for the hand-over, leaves the session here, and its will as it
// was: no new connection took the session on, so the will of its last
// connection, which ended without a DISCONNECT (the takeover closed a live
// one), still goes out once its delay has passed [MQTT-3.1.3-9]. Whether
// the connection was live, ended while the takeover ran, or had ended
// before it with its will waiting for its delay.
func TestBroker_WillOfASessionWhoseTakeoverFailedHere_MQTT_3_1_3_9(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		ended bool // the connection ended before the takeover, its will waiting
		hold  bool // it ends on its own while the takeover runs (held at its will)
	}{
		{name: "live"},
		{name: "ending_during_the_takeover", hold: true},
		{name: "ended_before", ended: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var fail atomic.Bool
			var during func()
			b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return loadFails{sharedLocal{st}, &fail, &during} })
			addr := serveTCP(t, b)
			const client, delay = "failing", 2
			id := b.mustScope(t, "default").ClientID(client)
			watcher := willWatcher(t, addr, "gone/"+client)

			old := connectWithWill(t, addr, 5, client, "gone/"+client, true, persistentSession, delay)
			epoch := waitBound(t, b, id)
			release := func() {}
			if tc.ended {
				_ = old.Conn.Close()
				waitUnbound(t, b.session(id))
			} else if tc.hold {
				release = endHeldAtWill(t, b, id, old)
			}
			// A connection ending while the takeover reads the store (the
			// live one it closed, or the one held at its will) finds the
			// session moving and leaves its will with the move.
			during = func() {
				release()
				if !tc.ended {
					waitParked(t, b.session(id))
				}
			}
			fail.Store(true)
			_, _, _, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, false)
			require.Error(t, err, "the takeover cannot read the session")
			release()
			fail.Store(false)
			if !tc.ended {
				expectClosed(t, old)
			}

			pk, err := watcher.Read(delay*time.Second + 3*time.Second)
			require.NoError(t, err, "the session stayed here, and no connection took it on: its will goes out after its delay")
			require.Equal(t, packets.Publish, pk.FixedHeader.Type)
			require.Equal(t, client, string(pk.Payload))
			watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			pk, err = watcher.Read(time.Second)
			require.Error(t, err, "the will is published once; got type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
		})
	}
}

// A session that moved to another edge takes its old connection's will
// along as void: the connection the takeover closed, ending after the
// move is done here, publishes nothing [MQTT-3.1.3-9].
func TestBroker_WillOfAConnectionEndingAfterItsSessionMoved_MQTT_3_1_3_9(t *testing.T) {
	t.Parallel()
	b, _ := brokerOnStore(t, func(st *durable.Store) DurableState { return sharedLocal{st} })
	addr := serveTCP(t, b)
	const client = "moved"
	id := b.mustScope(t, "default").ClientID(client)
	watcher := willWatcher(t, addr, "gone/"+client)

	old := connectWithWill(t, addr, 5, client, "gone/"+client, true, persistentSession, 0)
	epoch := waitBound(t, b, id)
	held, release := holdAtWill(t, b, id)
	owned, _, _, err := b.TakeOver(t.Context(), "default", client, "edge-new", epoch+1, false)
	require.NoError(t, err)
	require.True(t, owned)
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the closed connection's end did not come to its will")
	}
	_, err = b.TakeoverEnd(t.Context(), "default", client, epoch+1)
	require.NoError(t, err)
	release()
	expectClosed(t, old)
	pk, err := watcher.Read(2 * time.Second)
	require.Error(t, err, "the session went on elsewhere, yet its old connection's will came: type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
}
