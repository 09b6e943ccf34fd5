package broker

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Shared-group choices across resends. A message that a member of a group
// here took can still fail as a whole: another recipient's store write
// fails, a relay to a handed-over session's owner fails, or the publisher
// here is not acknowledged for another edge's sake. Its sender sends it
// again under the same msgID (a forward frame resent, a QoS 2 PUBLISH sent
// again with DUP), and each session takes a QoS 2 message once (took), but
// a group picking afresh, round robin, would hand it to another member: a
// QoS 2 message to two members ([MQTT-4.8.2-5], invariant 2), a QoS 1 one
// re-dispatched with no member refusing it or gone (DESIGN: shared
// subscriptions). So the members that took a message that then failed are
// remembered by msgID, and a resend goes to them again: a QoS 2 one, once
// its member is gone, to no other member of the group; a QoS 1 one to
// another, as a member's end re-dispatches it.

// groupPick is the member of one shared group that took a message.
type groupPick struct {
	name, filter string // the group (internal filter)
	session      string // the member's internal client ID
	qos          byte   // the QoS it took the message at
}

// hasGroup reports whether ps holds a pick of x's group.
func hasGroup(ps []groupPick, x groupPick) bool {
	return slices.ContainsFunc(ps, func(y groupPick) bool { return y.name == x.name && y.filter == x.filter })
}

// pickFor returns the pick of group g in ps, nil if none.
func pickFor(ps []groupPick, g *shareGroup) *groupPick {
	for i := range ps {
		if ps[i].name == g.name && ps[i].filter == g.filter {
			return &ps[i]
		}
	}
	return nil
}

// member returns g's member of session id, nil if it has none. index.mu
// must be held (read).
func (g *shareGroup) member(id string) *subscription {
	for _, m := range g.members {
		if m.sess.id == id {
			return m
		}
	}
	return nil
}

// sharedPickMemory is how long the picks of a message that failed are
// remembered: past the bound of a forward (ForwardBound, 30 s by default)
// its sender gives up, and a publisher not acknowledged sends its QoS 2
// PUBLISH again soon after, unless its connection ended. A resend later
// than that may find another member.
const sharedPickMemory = 2 * time.Minute

// sharedPickMax bounds the messages one sharedPicks remembers: past it the
// oldest go.
const sharedPickMax = 1 << 16

// A QoS 2 message is sent again also when it did not fail here: its
// publisher, on another edge, was not acknowledged for a third edge's
// sake, and sends it again with DUP under the same msgID. So the members
// that took a QoS 2 group message here are remembered whether or not it
// failed (DeliverForwarded). The publisher's edge remembers, for a QoS 2
// publish it did not acknowledge, the edge it chose for each group
// (Message.EdgeFor), so that the resend goes to the same edges, and
// forgets them and its own members' picks once the resend is acknowledged.
// Everything remembered goes after sharedPickMemory, or past
// sharedPickMax, whichever comes first: a receiving edge cannot tell when
// the publisher was acknowledged.
//
// The members of QoS 2 messages delivered are remembered apart from those
// of messages that failed (Broker.delivered, Broker.picks), each with its
// own bound: every QoS 2 group message delivered is remembered, and past
// about sharedPickMax/ForwardBound of them a second (2.2k/s at 30 s) they
// would push the pick of a message that failed out before its resend came,
// and the resend would go to a second member.

// sharedPicks remembers, by msgID, the members that took messages that
// then failed here (see above), and the edges chosen for the groups of
// QoS 2 messages published here and not acknowledged.
type sharedPicks struct {
	mu   sync.Mutex
	byID map[MsgID]remembered // guarded by mu
	// order holds what was remembered, by time; an entry whose seq is not
	// its msgID's any more (remembered again since, or forgotten) is
	// stale: it goes without taking the newer one with it. Guarded by mu.
	order []pickedAt
	seq   uint64       // the last remembered's; guarded by mu
	n     atomic.Int32 // len(byID): lookup's lock-free check
}

// remembered is what a sharedPicks holds for one msgID. Its slices are
// never changed in place, only replaced: lookup hands picks out without
// a copy.
type remembered struct {
	picks []groupPick
	edges []edgePick
	seq   uint64 // its entry in order
}

type pickedAt struct {
	id  MsgID
	at  time.Time
	seq uint64
}

// remember records the members of shared groups that took m here (m.picks),
// but those of sessions in except (their writes of m failed): m failed, and
// is sent again. A member recorded for a group before stays its member,
// unless it is in except: a pick recorded before its deferred write was
// settled (DeliverForwarded fails first, Deferred.Wait comes after) is
// forgotten once the write failed. Kept, a resend would go to that member
// again, and once it is gone a QoS 2 message would count as committed to
// a member that never had it, and go to nobody.
func (p *sharedPicks) remember(m *Message, except []*session) {
	p.rememberAt(time.Now(), m.ID, m.picks, m.edges, except)
}

// rememberAt is remember at now, of msgID id whose members picks took it
// and edges served its groups.
func (p *sharedPicks) rememberAt(now time.Time, id MsgID, picks []groupPick, edges []edgePick, except []*session) {
	failed := func(x groupPick) bool {
		return slices.ContainsFunc(except, func(s *session) bool { return s.id == x.session })
	}
	if len(except) > 0 {
		picks = slices.DeleteFunc(slices.Clone(picks), failed)
	}
	if len(picks) == 0 && len(except) == 0 && len(edges) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pruneLocked(now)
	r, ok := p.byID[id]
	if !ok && len(picks) == 0 && len(edges) == 0 {
		return
	}
	have := r.picks
	if len(except) > 0 {
		// A new slice: the one held may be in a lookup's hands.
		have = slices.DeleteFunc(slices.Clone(have), failed)
	}
	for _, x := range picks {
		if !hasGroup(have, x) {
			have = append(slices.Clip(have), x)
		}
	}
	r.picks = have
	if len(edges) > 0 {
		r.edges = slices.Clone(edges)
	}
	if p.byID == nil {
		p.byID = map[MsgID]remembered{}
	}
	// Remembered again, it is kept from now: the message is sent again
	// after this attempt, not the first.
	p.seq++
	r.seq = p.seq
	p.byID[id] = r
	p.order = append(p.order, pickedAt{id, now, p.seq})
	for len(p.order) > sharedPickMax {
		p.dropLocked(0)
		p.order = p.order[1:]
	}
	p.n.Store(int32(len(p.byID)))
}

// dropLocked forgets the message of order[i] unless it was remembered
// again since (a later entry is its own). p.mu must be held.
func (p *sharedPicks) dropLocked(i int) {
	e := p.order[i]
	if r, ok := p.byID[e.id]; ok && r.seq == e.seq {
		delete(p.byID, e.id)
	}
	p.order[i] = pickedAt{} // its msgID's edge name goes with it
}

// edgesFor returns the edges chosen for the shared groups of msgID id,
// remembered when its publisher was not acknowledged; nil if none. A
// copy: the caller records its choices in it (Message.ChoseEdge).
func (p *sharedPicks) edgesFor(id MsgID) []edgePick {
	if p.n.Load() == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pruneLocked(time.Now())
	return slices.Clone(p.byID[id].edges)
}

// forget drops what is remembered for msgID id: its publisher here was
// acknowledged, and does not send it again.
func (p *sharedPicks) forget(id MsgID) {
	if p.n.Load() == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.byID, id)
	// Its entry in order is stale now, and goes in its turn.
	p.n.Store(int32(len(p.byID)))
}

// lookup returns the picks remembered for msgID id, nil if none. Every
// QoS 1/2 message delivered here looks: the picks are not copied, and
// must not be changed.
func (p *sharedPicks) lookup(id MsgID) []groupPick {
	if p.n.Load() == 0 {
		return nil // most often: no clock read
	}
	return p.lookupAt(time.Now(), id)
}

func (p *sharedPicks) lookupAt(now time.Time, id MsgID) []groupPick {
	if p.n.Load() == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pruneLocked(now)
	return p.byID[id].picks
}

// pruneLocked forgets what was remembered longer than sharedPickMemory
// before now. p.mu must be held. It costs what it forgets, not what is
// kept (every lookup prunes): order is resliced past the entries that
// went, and append moves the ones kept to a new array once the old one
// is full, leaving the dead prefix behind.
func (p *sharedPicks) pruneLocked(now time.Time) {
	n := 0
	for n < len(p.order) && now.Sub(p.order[n].at) >= sharedPickMemory {
		p.dropLocked(n)
		n++
	}
	if n == 0 {
		return
	}
	p.order = p.order[n:]
	if len(p.order) == 0 {
		p.order = nil
	}
	p.n.Store(int32(len(p.byID)))
}

// rememberFailed remembers the members that took m, which failed here
// once the writes of the sessions in except failed (Deferred.Wait). Those
// sessions are forgotten as the members that took it also where m was
// remembered as delivered (DeliverForwarded returned before the writes
// were settled): they never had it.
func (b *Broker) rememberFailed(m *Message, except []*session) {
	b.picks.remember(m, except)
	if len(except) > 0 {
		b.delivered.rememberAt(time.Now(), m.ID, nil, nil, except)
	}
}

// pickedBefore returns the members of shared groups that took msgID id
// before: those remembered when it failed here and, for the other groups,
// those of its QoS 2 delivery. Not to be changed (lookup).
func (b *Broker) pickedBefore(id MsgID) []groupPick {
	failed, took := b.picks.lookup(id), b.delivered.lookup(id)
	if len(took) == 0 {
		return failed
	}
	if len(failed) == 0 {
		return took
	}
	out := slices.Clip(failed) // appended to: a copy
	for _, x := range took {
		if !hasGroup(failed, x) {
			out = append(out, x)
		}
	}
	return out
}

// rememberDelivery remembers the members of shared groups that took
// forwarded message m here, for its resend: m failed here, or is QoS 2,
// which can come again also when it did not fail here (its publisher was
// not acknowledged for another edge's sake).
func (b *Broker) rememberDelivery(m *Message, failed error) {
	switch {
	case len(m.picks) == 0:
	case failed != nil:
		b.picks.remember(m, nil)
	case m.QoS == 2:
		b.delivered.remember(m, nil)
	}
}
