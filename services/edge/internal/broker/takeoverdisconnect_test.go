package broker

import (
	"slices"
	"sync/atomic"
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
//
// mochi must not end it either: the old connection's end, with its
// expire set and the new connection's inheritClientSession still to come,
// removed the old client from Clients, with its subscriptions and in-flight
// state, so the new connection found nothing to inherit and its CONNACK
// said Session Present 0 for the session the edge resumed [MQTT-3.2.2-2],
// its PUBREL of the session's QoS 2 flow was answered "packet identifier
// not found", and its UNSUBSCRIBE of the session's filter "no subscription
// existed".
func TestBroker_OldConnectionsDisconnectAfterTakeoverDoesNotEndTheResumedSession(t *testing.T) {
	t.Parallel()
	b, st, gate, own, addr := brokerHoldingSecondStore(t)
	id := b.mustScope(t, "default").ClientID("disc")

	old := mqtttest.Dial(t, addr, 5)
	old.Connect("disc", true, persistentSession)
	require.Equal(t, []byte{1}, old.Subscribe(1, "disc/#", 1).ReasonCodes)
	// An inbound QoS 2 flow of the session, at its PUBREC.
	old.Publish(7, "other/q2", 2, []byte("q2"))
	require.Equal(t, uint16(7), old.Expect(packets.Pubrec).PacketID)
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
	// The old connection's end is over, mochi's housekeeping after its
	// OnDisconnect included (the count goes down last), before the new
	// connection inherits.
	require.Eventually(t, func() bool { return atomic.LoadInt64(&b.server.Info.ClientsConnected) == 1 },
		5*time.Second, time.Millisecond, "the old connection's end")
	gate.open()
	ack := <-acks
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.True(t, ack.SessionPresent, "the edge resumed the session")
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
	pub := newer.Expect(packets.Publish)
	require.Equal(t, []byte("p"), pub.Payload, "the session's subscription stays")
	newer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pub.PacketID})
	newer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 7})
	comp := newer.Expect(packets.Pubcomp)
	require.Equal(t, packets.CodeSuccess.Code, comp.ReasonCode, "the session's QoS 2 flow goes on in the new connection")
	cur, ok := b.server.Clients.Get(id)
	require.True(t, ok, "mochi knows the new connection")
	require.False(t, cur.Closed(), "mochi's record of the client is the new connection's")
	expectUnsubscribed(t, newer, "disc/#")
}

// expectUnsubscribed unsubscribes c from filter and requires the UNSUBACK
// to say the subscription existed: mochi's records of the connection hold
// what its session does.
func expectUnsubscribed(t *testing.T, c *mqtttest.Client, filter string) {
	t.Helper()
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 9,
		Filters: packets.Subscriptions{{Filter: filter}}})
	require.Equal(t, []byte{packets.CodeSuccess.Code}, c.Expect(packets.Unsuback).ReasonCodes, "the session held %s", filter)
}

// Session Present says what the edge decided for the session
// (SessionFate), not whether mochi still had a record of the client to
// inherit from: a session the edge resumes is present [MQTT-3.2.2-2], with
// the subscriptions it holds, even when mochi's record of the previous
// connection is gone. It is taken out here as mochi's end of an abandoned
// CONNECT takes it out (abandonConnect, for a connection whose session
// does not outlive it), while the edge leaves the session that CONNECT
// took on to the client's next one.
func TestBroker_ResumedSessionIsPresentWithoutMochisRecordOfIt(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	id := b.mustScope(t, "default").ClientID("unrecorded")
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("unrecorded", true, persistentSession)
	require.Equal(t, []byte{1}, c.Subscribe(1, "unrecorded/#", 1).ReasonCodes)
	waitBound(t, b, id)
	_ = c.Conn.Close()
	waitUnbound(t, b.session(id))
	gone, ok := b.server.Clients.Get(id)
	require.True(t, ok)
	gone.ClearInflights()
	b.server.UnsubscribeClient(gone)
	require.True(t, b.server.Clients.DeleteIf(id, gone))

	again := mqtttest.Dial(t, addr, 5)
	ack := again.Connect("unrecorded", false, persistentSession)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.True(t, ack.SessionPresent, "the edge resumed the session")
	waitBound(t, b, id)
	require.NoError(t, b.Publish("default", "unrecorded/a", []byte("p"), 1, false))
	pub := again.Expect(packets.Publish)
	require.Equal(t, []byte("p"), pub.Payload, "the session's subscription stays")
	again.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pub.PacketID})
	expectUnsubscribed(t, again, "unrecorded/#")
}
