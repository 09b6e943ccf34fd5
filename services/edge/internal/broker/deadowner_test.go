package broker

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A session that does not outlive its connection (MQTT 5 Session Expiry 0,
// a 3.1.1 clean session) ended with its connection when the edge that held
// it died; the shared store kept its record for its will alone. A CONNECT
// without Clean Start that claims it from the dead edge starts a new
// session: Session Present 0 [MQTT-3.2.2-3], nothing of the record carried
// over (§3.1.2.11.2; 3.1.1 [MQTT-3.1.2-6]). The will the record kept goes
// out now, once: the session ended, so its delay is over ([MQTT-3.1.3-9]).
func TestBroker_ClaimFromADeadEdgeDoesNotResumeASessionThatEndedWithIt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		version byte
		clean   bool
	}{
		{"mqtt5_expiry_0", 5, false},
		{"mqtt311_clean_session", 4, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, st := brokerOnStore(t, func(s *durable.Store) DurableState { return sharedLocal{s} })
			var epochs atomic.Uint64
			epochs.Store(10)
			b.SetCluster(Cluster{Ownership: grantOwnership(func() Grant {
				return Grant{Epoch: epochs.Add(1), Previous: "dead", SourceGone: true}
			})})
			addr := serveTCP(t, b)
			sc := b.mustScope(t, "default")
			id := sc.ClientID("orphan")
			watcher := mqtttest.Dial(t, addr, 5)
			watcher.Connect("watcher", true, packets.Properties{})
			require.Equal(t, []byte{1}, watcher.Subscribe(1, "gone/orphan", 1).ReasonCodes)

			will := b.newWill(sc.Topic("gone/orphan"), []byte("orphan"), 1, false, Props{})
			require.NoError(t, st.PutSession(t.Context(), durable.Session{ID: id, ProtocolVersion: tc.version, Clean: tc.clean,
				Will: &durable.Will{Msg: will.record(), Delay: 30}}))
			require.NoError(t, st.PutSubscription(t.Context(), id, durable.Subscription{Filter: sc.Topic("orphan/#"), QoS: 1}))

			c := mqtttest.Dial(t, addr, 5)
			ack := c.Connect("orphan", false, persistentSession)
			require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
			require.False(t, ack.SessionPresent, "the session ended with its connection on the dead edge")
			expectWillsOnce(t, watcher, "orphan")

			require.NoError(t, b.Publish("default", "orphan/a", []byte("x"), 1, false))
			pk, err := c.Read(500 * time.Millisecond)
			require.Error(t, err, "nothing of the ended session's subscriptions: got type %d, payload %q", pk.FixedHeader.Type, pk.Payload)
			stored, ok, err := st.LoadSession(t.Context(), id)
			require.NoError(t, err)
			require.True(t, ok, "the new session is stored")
			require.Equal(t, uint32(300), stored.Session.ExpiryInterval)
			require.Nil(t, stored.Session.Will, "the ended session's will went out; none is kept")
			require.Empty(t, stored.Subs)
		})
	}
}
