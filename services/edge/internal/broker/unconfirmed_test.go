package broker

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// The stored PUBREC state of an unacknowledged QoS 2 publish keeps its
// msgID, marked: a session restored from the store (after a restart, or on
// the edge the client resumes it on) routes the client's resend under it,
// and mochi does not answer the resend as a duplicate of something taken.
func TestBroker_UnconfirmedQoS2RestoredFromStore(t *testing.T) {
	t.Parallel()
	u := unconfirmedPub{id: MsgID{Edge: "edge-a", Incarnation: 3, Seq: 99}, fp: fingerprint("t/x", []byte("p"))}
	b, sc, _, st := storedSession(t, "pub")
	st.Incoming = []durable.Incoming{{PacketID: 7, MsgID: "edge-a/3/99", Unconfirmed: true, Fingerprint: u.fp}, {PacketID: 8, MsgID: "edge-a/3/100"}}
	s, _, _, incoming := b.adopt(st, sc, fromRecord)
	require.Len(t, incoming, 1, "mochi holds only the acknowledged one")
	require.Equal(t, uint16(8), incoming[0].PacketID)

	require.Equal(t, u, s.unconfirmed[7])
	id, ok := s.takeUnconfirmed(7, false, "t/x", []byte("p"))
	require.False(t, ok, "not a resend without DUP")
	require.Zero(t, id)
	s.unconfirmed[7] = u
	_, ok = s.takeUnconfirmed(7, true, "t/x", []byte("other"))
	require.False(t, ok, "another message under the packet ID")
	s.unconfirmed[7] = u
	id, ok = s.takeUnconfirmed(7, true, "t/x", []byte("p"))
	require.True(t, ok)
	require.Equal(t, u.id, id)
}

// A session remembers the QoS 2 deliveries it took, the last tookQoS2Len
// of them.
func TestSession_RemembersQoS2Taken(t *testing.T) {
	t.Parallel()
	s := &session{}
	for i := range tookQoS2Len + 10 {
		s.rememberQoS2(MsgID{Edge: "e", Seq: uint64(i)})
	}
	require.False(t, s.took.has(MsgID{Edge: "e", Seq: 5}), "evicted")
	require.True(t, s.took.has(MsgID{Edge: "e", Seq: 20}))
	require.True(t, s.took.has(MsgID{Edge: "e", Seq: tookQoS2Len + 9}))
	require.Len(t, s.took.ids, tookQoS2Len)
}
