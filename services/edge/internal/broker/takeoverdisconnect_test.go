package broker

import (
	"slices"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// A CONNECT without Clean Start that took a persistent session over
// (takeOver raised its epoch, the old connection detached) resumes it,
// whatever the old connection's DISCONNECT read after that says: a
// Session Expiry of 0 there is on a connection no longer the session's
// (disconnecting ignores it). The old connection's OnDisconnect, with
// expire set by that DISCONNECT and mochi's isTakenOver not yet set
// (inheritClientSession comes after OnSessionEstablish), ended the
// session under the new claim's epoch: the new connection's claim was
// released (invariant 3), its record deleted, its subscriptions gone.
func TestBroker_OldConnectionsDisconnectAfterTakeoverDoesNotEndTheResumedSession(t *testing.T) {
	t.Parallel()
	b, st, gate, own, addr := brokerHoldingSecondStore(t)
	id := b.mustScope(t, "default").ClientID("disc")

	old := mqtttest.Dial(t, addr, 5)
	old.Connect("disc", true, persistentSession)
	require.Equal(t, []byte{1}, old.Subscribe(1, "disc/#", 1).ReasonCodes)
	waitBound(t, b, id)

	newer := mqtttest.Dial(t, addr, 5)
	acks := make(chan packets.Packet, 1)
	go func() { acks <- newer.Connect("disc", false, persistentSession) }()
	select {
	case <-gate.entered: // taken over: the old connection detached, the new record being stored
	case <-time.After(5 * time.Second):
		t.Fatal("the new CONNECT did not store its session")
	}
	old.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect},
		Properties: packets.Properties{SessionExpiryInterval: 0, SessionExpiryIntervalFlag: true}})
	time.Sleep(300 * time.Millisecond)
	gate.open()
	ack := <-acks
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	epoch := waitBound(t, b, id)
	time.Sleep(200 * time.Millisecond)

	own.mu.Lock()
	released := slices.Clone(own.released)
	own.mu.Unlock()
	require.NotContains(t, released, epoch, "the new connection's claim is not released")
	_, ok, err := st.LoadSession(t.Context(), id)
	require.NoError(t, err)
	require.True(t, ok, "the resumed session's record is stored")
	require.NoError(t, b.Publish("default", "disc/a", []byte("p"), 1, false))
	require.Equal(t, []byte("p"), newer.Expect(packets.Publish).Payload, "the session's subscription stays")
	// Not fixed here: mochi's serveClient, after the old connection's
	// OnDisconnect, still deletes its Clients entry (expire, isTakenOver not
	// yet set), so inheritClientSession finds nothing and the CONNACK says
	// Session Present 0 for the session the edge resumes.
	if !ack.SessionPresent {
		t.Log("known: Session Present 0 for the resumed session (mochi deleted the old Clients entry)")
	}
}
