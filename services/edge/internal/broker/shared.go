package broker

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"time"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Shared-subscription re-dispatch (DESIGN: shared subscriptions). A QoS 1
// group message sent to a member whose session ends before its client
// acknowledged it, or that the client refused (PUBACK reason code ≥ 0x80),
// goes to another member of the group (MQTT 5.0 §4.8.2: the server SHOULD
// send it to another subscribed client once the session ends). A QoS 2
// group message is committed to its member and is never re-dispatched:
// when that session ends it is dropped, and counted ([MQTT-4.8.2-5]).
//
// A persistent member that only disconnects keeps its group messages and
// gets them again when it comes back: its session has not ended.
//
// A QoS 1 group message forwarded from another edge stays that edge's (its
// origin) while the copy here would not outlive this edge: the origin keeps
// it until this edge reports the member's PUBACK, and re-dispatches it when
// this edge reports the member gone, or dies (DESIGN: the publishing edge
// owns a QoS 1 group message until the member's PUBACK is reported back).
// A copy that outlives this edge (stored durably for a persistent member,
// or sent at QoS 0) is reported acknowledged as soon as it is taken.

// sentShared records a QoS 1 group delivery sent under packetID. Writer
// only.
func (s *session) sentShared(packetID uint16, d *delivery) {
	s.mu.Lock()
	if s.sharedOut == nil {
		s.sharedOut = map[uint16]delivery{}
	}
	s.sharedOut[packetID] = delivery{msg: d.msg, qos: d.qos, group: d.group, origin: d.origin}
	s.nShared.Store(int32(len(s.sharedOut)))
	s.mu.Unlock()
}

// ackedShared forgets the group delivery under packetID, returning it.
func (s *session) ackedShared(packetID uint16) (delivery, bool) {
	if s.nShared.Load() == 0 {
		return delivery{}, false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.sharedOut[packetID]
	if ok {
		delete(s.sharedOut, packetID)
		s.nShared.Store(int32(len(s.sharedOut)))
	}
	return d, ok
}

// orphanedShared takes, from a session that ends, the group messages its
// client never acknowledged: those sent and those still queued (queued
// of them). With keptOnly, only those an origin keeps: the rest go along
// with a session that moves. s.mu must be held.
func (s *session) orphanedShared(keptOnly bool) (out []delivery, queued int) {
	for _, d := range s.sharedOut {
		if !keptOnly || d.origin != nil {
			out = append(out, d)
		}
	}
	// Sent in arrival order, so re-dispatched in it.
	slices.SortFunc(out, func(a, b delivery) int { return cmp.Compare(a.msg.Created, b.msg.Created) })
	s.sharedOut = nil
	s.nShared.Store(0)
	for i := 0; i < s.queue.len(); i++ {
		if d := s.queue.at(i); d.group != nil && d.qos > 0 && (!keptOnly || d.origin != nil) {
			out = append(out, delivery{msg: d.msg, qos: d.qos, group: d.group, origin: d.origin})
			queued++
		}
	}
	return out, queued
}

// redispatchAll hands group messages left by a member that went away (or
// refused them: why) to other members, in the background: an ending
// session must not wait for another member's room.
func (b *Broker) redispatchAll(from *session, orphans []delivery, why ShareOutcome) {
	if len(orphans) == 0 {
		return
	}
	b.releases.Add(1)
	go func() {
		defer b.releases.Done()
		for _, d := range orphans {
			b.redispatch(from, d, why)
		}
	}()
}

// redispatch gives one group message to another member of its group: a
// connected one on this edge; else, for a message another edge keeps, back
// to that edge; else one on another edge, else the queue of a persistent
// member here. A QoS 2 message is committed to the member it went to: it is
// dropped, and counted.
func (b *Broker) redispatch(from *session, d delivery, why ShareOutcome) {
	if d.qos == 2 {
		b.m.sharedRedispatch.WithLabelValues("qos2_dropped").Inc()
		return
	}
	g := d.group
	if m := b.index.pickOther(g.name, g.filter, from, true); m != nil {
		b.deliverShared(m, d, "local")
		return
	}
	key, ok := outsideGroup(from.scope, g)
	if !ok {
		return
	}
	if d.origin != nil && b.cluster.Reports != nil && b.cluster.Reports.ReportShared(*d.origin, d.msg, key, why) {
		b.m.sharedRedispatch.WithLabelValues("returned").Inc()
		return
	}
	b.redispatchFurther(from, d, key, g.filter, "")
}

// RedispatchShared gives a QoS 1 group message this edge forwarded, and
// kept, to another member of group: the edge it went to reported its member
// gone (or refusing it), or died. It never goes to notEdge, that edge.
func (b *Broker) RedispatchShared(pm *commonv1.Message, group GroupKey, notEdge string) {
	m, err := b.fromProto(pm)
	if err != nil {
		b.logger.Warn("shared group message not re-dispatched", "group", group.Name, "error", err)
		return
	}
	sc, err := b.scope(pm.GetTenant())
	if err != nil {
		return
	}
	inner, _ := sc.Filter(group.Filter)
	d := delivery{msg: m, qos: 1}
	if sub := b.index.pickOther(group.Name, inner, nil, true); sub != nil {
		b.deliverShared(sub, d, "local")
		return
	}
	b.redispatchFurther(nil, d, group, inner, notEdge)
}

// redispatchAttempts bounds the forwards tried for one re-dispatch.
const redispatchAttempts = 3

// redispatchSettleBound bounds how long a re-dispatch waits for routes
// that have not settled ([ErrRoutesUnsettled]): longer than the router's
// settle round and its rebuild wait after every router node was lost.
const redispatchSettleBound = 30 * time.Second

// redispatchFurther is the rest of a re-dispatch, once no connected member
// here took the message: a member on another edge (not notEdge), else the
// queue of a persistent member here, else nobody (counted).
func (b *Broker) redispatchFurther(from *session, d delivery, key GroupKey, innerFilter, notEdge string) {
	// A forward that fails (the edge picked went too) is tried again: the
	// next attempt resolves the group's edges afresh. Routes that may not
	// know the group's members yet are waited for, within a bound of their
	// own: "no member" is only believed from settled routes.
	settleBy := time.Now().Add(redispatchSettleBound)
	for attempt := 1; b.cluster.Peers != nil && attempt <= redispatchAttempts; {
		ctx, cancel := context.WithTimeout(b.stopped, 30*time.Second)
		wait, err := b.cluster.Peers.ForwardShared(ctx, d.msg, key, notEdge)
		if err == nil && wait != nil {
			err = wait()
		}
		cancel()
		if err == nil {
			b.m.sharedRedispatch.WithLabelValues("forwarded").Inc()
			return
		}
		if errors.Is(err, ErrNoMember) || b.stopped.Err() != nil {
			break
		}
		backoff := time.Duration(attempt) * 500 * time.Millisecond
		if errors.Is(err, ErrRoutesUnsettled) && b.index.pickOther(key.Name, innerFilter, from, false) != nil {
			break // a persistent member here keeps it: nothing is lost by not waiting
		}
		if errors.Is(err, ErrRoutesUnsettled) && time.Now().Before(settleBy) {
			backoff = 200 * time.Millisecond
		} else {
			b.logger.Warn("shared group message not re-dispatched to another edge", "group", key.Name, "attempt", attempt, "error", err)
			attempt++
		}
		select {
		case <-b.stopped.Done():
		case <-time.After(backoff):
		}
	}
	// Nobody is connected: a persistent member keeps it for when it is.
	m := b.index.pickOther(key.Name, innerFilter, from, false)
	if m == nil {
		b.m.sharedRedispatch.WithLabelValues("no_member").Inc()
		b.logger.Warn("shared group message dropped: no other member", "group", key.Name, "msg_id", msgIDString(d.msg.ID))
		return
	}
	b.deliverShared(m, d, "queued")
}

// deliverShared queues a re-dispatched group message for member m. A
// message another edge keeps stays that edge's here too.
func (b *Broker) deliverShared(m *subscription, d delivery, outcome string) {
	nd := delivery{msg: d.msg, qos: min(d.msg.QoS, m.qos), ids: m.ids, group: m.group}
	if d.origin != nil {
		_, _ = b.takeReported(m.sess, nd, d.origin, false)
		b.m.sharedRedispatch.WithLabelValues(outcome).Inc()
		return
	}
	if r := m.sess.enqueue(nd); r != enqueued {
		b.m.sharedRedispatch.WithLabelValues("refused").Inc()
		return
	}
	b.m.sharedRedispatch.WithLabelValues(outcome).Inc()
}

// takeReported queues for member session s a group message that origin
// forwarded and keeps. A QoS 1 copy that would not outlive this edge stays
// the origin's until the member acknowledges it or goes; any other copy is
// reported acknowledged once taken. One not taken (the member is gone, or
// stayed full) goes to another member here when mayPick, else back to the
// origin. The error is the store's: the message is not taken, and the frame
// that carried it is sent again. enqueuedHere: s took it.
func (b *Broker) takeReported(s *session, d delivery, origin *ShareOrigin, mayPick bool) (enqueuedHere bool, _ error) {
	volatile := d.qos == 1 && !(s.wasDurable() && b.store != nil && b.store.Shared())
	if volatile {
		d.origin = origin
	}
	r := s.enqueue(d)
	err := b.counted(r)
	if err != nil {
		return false, err
	}
	taken := r == enqueued || (r == droppedOverflow && b.cfg.OfflineDropOldest && !volatile)
	key, ok := outsideGroup(s.scope, d.group)
	switch {
	case !taken && mayPick:
		d.origin = origin
		b.redispatchAll(s, []delivery{d}, ShareMemberGone)
	case !ok || b.cluster.Reports == nil:
	case !taken:
		if !b.cluster.Reports.ReportShared(*origin, d.msg, key, ShareMemberGone) {
			b.m.sharedRedispatch.WithLabelValues("refused").Inc()
		}
	case !volatile:
		b.cluster.Reports.ReportShared(*origin, d.msg, key, ShareAcked)
	}
	return r == enqueued, nil
}

// reportAcked tells the origin of a group message the member acknowledged.
func (b *Broker) reportAcked(s *session, d delivery) {
	if d.origin == nil || b.cluster.Reports == nil {
		return
	}
	if key, ok := outsideGroup(s.scope, d.group); ok {
		b.cluster.Reports.ReportShared(*d.origin, d.msg, key, ShareAcked)
	}
}

// reportUnserved tells the origin of a message about every group it chose
// this edge for that has no member here any more: it re-dispatches. A
// group whose member left this edge and was relayed the message (relayed)
// is reported acknowledged: the member's new owner took it.
func (b *Broker) reportUnserved(m *Message, shared SharedChoice, served, relayed []*shareGroup) {
	if b.cluster.Reports == nil || len(served) == len(shared.Groups) {
		return
	}
	tenant, _, ok := tenancy.TenantOfTopic(m.Topic)
	if !ok {
		return
	}
	sc, err := b.scope(tenant)
	if err != nil {
		return
	}
	for _, g := range shared.Groups {
		inner, _ := sc.Filter(g.Filter)
		is := func(s *shareGroup) bool { return s.name == g.Name && s.filter == inner }
		switch {
		case slices.ContainsFunc(served, is):
		case slices.ContainsFunc(relayed, is):
			b.cluster.Reports.ReportShared(*shared.Origin, m, g, ShareAcked)
		default:
			b.cluster.Reports.ReportShared(*shared.Origin, m, g, ShareMemberGone)
		}
	}
}

// outsideGroup names g as other edges know it: the group and its filter in
// the tenant's outside form.
func outsideGroup(sc *tenancy.Scope, g *shareGroup) (GroupKey, bool) {
	f, ok := sc.ExternalTopic(g.filter)
	if !ok {
		return GroupKey{}, false
	}
	return GroupKey{Name: g.name, Filter: f}, true
}
