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

	bb := newEdgeB(t, &activatingStore{sharedLocal: sharedLocal{st}, activated: activated})

	const client = "ends-on-claim"
	id := a.mustScope(t, "default").ClientID(client)
	watchA := watchWills(t, addrA, "watchA", client)

	old := connectWithWill(t, addrA, 5, client, "gone/"+client, true, packets.Properties{}, 60)
	epoch := waitBound(t, a, id)
	rec, ok, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok)
	require.NotNil(t, rec.Session.Will, "the will is in the shared record")

	takesFrom(bb, a, client, epoch, clean)
	addrB := serveTCP(t, bb)
	watchB := watchWills(t, addrB, "watchB", client)

	ack := mqtttest.Dial(t, addrB, 5).Connect(client, clean, persistentSession)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	expectClosed(t, old)

	n := countPublishes(t, watchA, 1500*time.Millisecond) + countPublishes(t, watchB, 1500*time.Millisecond)
	require.Equal(t, 1, n, "the will of the ended session is published once across the two edges")
}

// newEdgeB starts a second edge, edge-b, on store, which it shares with
// the test's first edge.
func newEdgeB(t *testing.T, store DurableState) *Broker {
	t.Helper()
	cfg := DefaultConfig()
	cfg.EdgeID = "edge-b"
	bb, err := New(cfg, anonymous(), testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	t.Cleanup(func() { _ = bb.Close() })
	require.NoError(t, bb.Restore(store))
	return bb
}

// takesFrom makes bb claim client's session under epoch+1, taking it over
// from a (TakeOver, with clean for the CONNECT's Clean Start).
func takesFrom(bb, a *Broker, client string, epoch uint64, clean bool) {
	tk := &scriptedTakeover{begin: func(newEpoch uint64) ([]byte, error) {
		_, _, state, err := a.TakeOver(context.Background(), "default", client, "edge-b", newEpoch, clean)
		return state, err
	}}
	bb.SetCluster(Cluster{Takeover: tk, Ownership: grantOwnership(func() Grant {
		return Grant{Epoch: epoch + 1, Previous: "test"}
	})})
}

// countPublishes reads w until it is silent for quiet, acknowledging each
// PUBLISH, and returns how many came.
func countPublishes(t *testing.T, w *mqtttest.Client, quiet time.Duration) int {
	t.Helper()
	n := 0
	for {
		pk, err := w.Read(quiet)
		if err != nil {
			return n
		}
		if pk.FixedHeader.Type == packets.Publish {
			n++
			w.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
	}
}

// watchWills connects a clean client named name to addr, subscribed at
// QoS 1 to the will topic of client ("gone/" + client).
func watchWills(t *testing.T, addr, name, client string) *mqtttest.Client {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	c.Connect(name, true, packets.Properties{})
	require.Equal(t, []byte{1}, c.Subscribe(1, "gone/"+client, 1).ReasonCodes)
	return c
}
