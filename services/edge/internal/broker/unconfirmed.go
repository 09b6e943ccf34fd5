package broker

import (
	"hash/fnv"
	"sync/atomic"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Exactly once across a failed forward. A QoS 2 PUBLISH that not every
// recipient took is not acknowledged: the client sends it again, with DUP
// set, under the same packet ID. Routed under a new msgID, the resend would
// reach twice the recipients that took the first copy. So the msgID the
// first copy went under is kept with its packet ID (in the session, and in
// the stored PUBREC state of a durable session, marked unconfirmed), the
// resend goes under it again, and a session drops a QoS 2 delivery whose
// msgID it already took.

// unconfirmedPub is a QoS 2 publish that was not acknowledged.
type unconfirmedPub struct {
	id MsgID
	// fp fingerprints topic and payload: a different message sent under
	// the packet ID is not the resend.
	fp uint64
}

func fingerprint(topic string, payload []byte) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(topic))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write(payload)
	return h.Sum64()
}

// unconfirm records that the QoS 2 publish m under packetID was not
// acknowledged: the client's resend goes under m's msgID again. The stored
// PUBREC state of a durable session says so already: it is written
// unconfirmed before the message is routed (OnPublish).
func (b *Broker) unconfirm(cl *mqtt.Client, qos byte, packetID uint16, m *Message) {
	if qos != 2 {
		return
	}
	// The resend goes to the members of shared groups here that took it,
	// and to the edges chosen for the others.
	if len(m.picks) > 0 || len(m.edges) > 0 {
		b.picks.remember(m, nil)
	}
	u := unconfirmedPub{id: m.ID, fp: fingerprint(m.Topic, m.Payload)}
	s := b.session(cl.ID)
	if s == nil {
		return
	}
	s.mu.Lock()
	if s.unconfirmed == nil {
		s.unconfirmed = map[uint16]unconfirmedPub{}
	}
	s.unconfirmed[packetID] = u
	s.mu.Unlock()
}

// pubrelMoved completes, for mochi, a QoS 2 flow whose PUBREC was sent
// before the session was loaded here (a takeover, custody, or a restart):
// its stored state is unconfirmed, so it is known only as a resend to
// expect, and mochi would answer the PUBREL "packet identifier not found".
// A PUBREL means the client got the PUBREC, which is sent only once every
// recipient took the message; the flow is then complete, as if the PUBREC
// state had been loaded.
func (s *session) pubrelMoved(cl *mqtt.Client, packetID uint16) {
	if _, ok := cl.State.Inflight.TypeInbound(packetID); ok {
		return
	}
	s.mu.Lock()
	_, ok := s.unconfirmed[packetID]
	delete(s.unconfirmed, packetID)
	s.mu.Unlock()
	if ok && cl.State.Inflight.Set(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrec}, PacketID: packetID}) {
		atomic.AddInt64(&s.b.server.Info.Inflight, 1) // mochi takes it off with the PUBCOMP
	}
}

// confirmed forgets the shared-group choices remembered for QoS 2 message
// m published here (unconfirm) once its PUBREC is sent: the client does
// not send the PUBLISH again.
func (b *Broker) confirmed(m *Message) {
	if m != nil && m.QoS == 2 && (len(m.edges) > 0 || len(m.picks) > 0) {
		b.picks.forget(m.ID)
	}
}

// takeUnconfirmed returns the msgID of the unacknowledged publish under
// packetID when a PUBLISH is its resend (DUP, same topic and payload), and
// forgets it either way: the packet ID is in use again.
func (s *session) takeUnconfirmed(packetID uint16, dup bool, topic string, payload []byte) (MsgID, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	u, ok := s.unconfirmed[packetID]
	if !ok {
		return MsgID{}, false
	}
	delete(s.unconfirmed, packetID)
	if !dup || u.fp != fingerprint(topic, payload) {
		return MsgID{}, false
	}
	return u.id, true
}

// tookQoS2 keeps the msgIDs of the last QoS 2 deliveries a session took.
type tookQoS2 struct {
	ids  map[MsgID]struct{}
	ring []MsgID // insertion order, for eviction
	next int
}

// tookQoS2Len bounds what a session remembers: a resend comes within
// seconds of the failed forward, after far fewer QoS 2 messages than this.
const tookQoS2Len = 1024

// has reports whether the message was taken (t may be nil).
func (t *tookQoS2) has(id MsgID) bool {
	if t == nil {
		return false
	}
	_, ok := t.ids[id]
	return ok
}

// tookIDsLocked lists the msgIDs the session remembers taking at QoS 2, for the
// edge the session moves to, but those in except. s.mu must be held.
//
// A message whose stored copy is still being written (unsettled: a
// forwarded frame's writes are settled after its messages were queued) is
// left out: it is taken only once that write succeeds, and it may fail
// after the move, when this copy forgets it. Named to the new owner, the
// message's relay or resend would be answered there as taken before, and
// acknowledged with no copy anywhere.
func (s *session) tookIDsLocked(except map[MsgID]struct{}) []string {
	if s.took == nil {
		return nil
	}
	undecided := except
	if len(s.unsettled) > 0 {
		undecided = make(map[MsgID]struct{}, len(s.unsettled)+len(except))
		for id := range except {
			undecided[id] = struct{}{}
		}
		for _, w := range s.unsettled {
			undecided[w.id] = struct{}{}
		}
	}
	t := s.took
	out := make([]string, 0, len(t.ids))
	// Oldest first (next is the oldest slot once the ring is full), so the
	// new owner evicts them in the same order.
	for i := range t.ring {
		id := t.ring[(t.next+i)%len(t.ring)]
		if _, ok := t.ids[id]; !ok {
			continue
		}
		if _, ok := undecided[id]; ok {
			continue
		}
		out = append(out, msgIDString(id))
	}
	return out
}

// rememberQoS2 records a QoS 2 delivery the session took.
func (s *session) rememberQoS2(id MsgID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t := s.took
	if t == nil {
		t = &tookQoS2{ids: make(map[MsgID]struct{}, 16)}
		s.took = t
	}
	if _, ok := t.ids[id]; ok {
		return
	}
	if len(t.ring) < tookQoS2Len {
		t.ring = append(t.ring, id)
	} else {
		delete(t.ids, t.ring[t.next])
		t.ring[t.next] = id
		t.next = (t.next + 1) % tookQoS2Len
	}
	t.ids[id] = struct{}{}
}

// lateIDsLocked returns the msgIDs of the deliveries queued for s after
// seq: those a moving session hands over late. s.mu must be held.
func lateIDsLocked(s *session, seq uint64) map[MsgID]struct{} {
	var ids map[MsgID]struct{}
	for i := range s.queue.len() {
		if d := s.queue.at(i); d.seq > seq && d.msg != nil {
			if ids == nil {
				ids = map[MsgID]struct{}{}
			}
			ids[d.msg.ID] = struct{}{}
		}
	}
	return ids
}
