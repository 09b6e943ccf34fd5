package broker

import (
	"context"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// asyncDeleteStore models remotestore: DeleteSession(wait=false) is queued
// and returns at once; it reaches the service only after the new owner's
// Activate, which fences it (older epoch): it is refused, nothing deleted.
type asyncDeleteStore struct {
	sharedLocal
	activated chan struct{} // closed by the new owner's Activate
	async     bool
}

func (s *asyncDeleteStore) DeleteSession(ctx context.Context, id string, wait bool) error {
	if wait || !s.async {
		return s.sharedLocal.DeleteSession(ctx, id, wait)
	}
	go func() { <-s.activated }() // in flight; refused once the newer epoch is active
	return nil
}

type activatingStore struct {
	sharedLocal
	activated chan struct{}
}

func (s *activatingStore) Activate(context.Context, string, uint64) error {
	select {
	case <-s.activated:
	default:
		close(s.activated)
	}
	return nil
}

// TestBroker_WillOfASessionEndedByAnotherEdgesClaimIsPublishedOnce: edge A
// holds a session with a will (kept in the shared record) that ends when
// edge B claims it (Session Expiry 0 without Clean Start, or Clean Start).
// A publishes the will as its connection ends; the record holding it must
// be gone from the store before B reads it, although the end's own delete
// is queued (remotestore) and B's activation fences it off: B would
// publish the will again.
func TestBroker_WillOfASessionEndedByAnotherEdgesClaimIsPublishedOnce(t *testing.T) {
	for _, tc := range []struct {
		name         string
		async, clean bool
	}{{"async_noclean", true, false}, {"sync_noclean", false, false}, {"async_clean", true, true}} {
		t.Run(tc.name, func(t *testing.T) { willPublishedOnceAcrossEdges(t, tc.async, tc.clean) })
	}
}

func willPublishedOnceAcrossEdges(t *testing.T, async, clean bool) {
	activated := make(chan struct{})
	a, st := brokerOnStore(t, func(s *durable.Store) DurableState {
		return &asyncDeleteStore{sharedLocal: sharedLocal{s}, activated: activated, async: async}
	})
	addrA := serveTCP(t, a)

	cfg := DefaultConfig()
	cfg.EdgeID = "edge-b"
	bb, err := New(cfg, anonymous(), testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	t.Cleanup(func() { _ = bb.Close() })
	require.NoError(t, bb.Restore(&activatingStore{sharedLocal: sharedLocal{st}, activated: activated}))

	const client = "ends-on-claim"
	id := a.mustScope(t, "default").ClientID(client)
	watchA := mqtttest.Dial(t, addrA, 5)
	watchA.Connect("watchA", true, packets.Properties{})
	require.Equal(t, []byte{1}, watchA.Subscribe(1, "gone/"+client, 1).ReasonCodes)

	old := connectWithWill(t, addrA, 5, client, "gone/"+client, true, packets.Properties{}, 60)
	epoch := waitBound(t, a, id)
	rec, ok, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok)
	require.NotNil(t, rec.Session.Will, "the will is in the shared record")

	tk := &scriptedTakeover{begin: func(newEpoch uint64) ([]byte, error) {
		_, _, state, err := a.TakeOver(context.Background(), "default", client, "edge-b", newEpoch, clean)
		return state, err
	}}
	bb.SetCluster(Cluster{Takeover: tk, Ownership: grantOwnership(func() Grant {
		return Grant{Epoch: epoch + 1, Previous: "test"}
	})})
	addrB := serveTCP(t, bb)
	watchB := mqtttest.Dial(t, addrB, 5)
	watchB.Connect("watchB", true, packets.Properties{})
	require.Equal(t, []byte{1}, watchB.Subscribe(1, "gone/"+client, 1).ReasonCodes)

	ack := mqtttest.Dial(t, addrB, 5).Connect(client, clean, persistentSession)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	expectClosed(t, old)

	n := 0
	for _, w := range []*mqtttest.Client{watchA, watchB} {
		for {
			pk, err := w.Read(1500 * time.Millisecond)
			if err != nil {
				break
			}
			if pk.FixedHeader.Type == packets.Publish {
				n++
				t.Logf("will received by %s", map[*mqtttest.Client]string{watchA: "watcher on A", watchB: "watcher on B"}[w])
				w.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			}
		}
	}
	require.Equal(t, 1, n, "the will of the ended session is published once across the two edges")
}
