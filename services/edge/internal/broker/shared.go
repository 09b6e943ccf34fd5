package broker

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"time"
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

// sentShared records a QoS 1 group delivery sent under packetID. Writer
// only.
func (s *session) sentShared(packetID uint16, d *delivery) {
	s.mu.Lock()
	if s.sharedOut == nil {
		s.sharedOut = map[uint16]delivery{}
	}
	s.sharedOut[packetID] = delivery{msg: d.msg, qos: d.qos, group: d.group}
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
// of them). s.mu must be held.
func (s *session) orphanedShared() (out []delivery, queued int) {
	for _, d := range s.sharedOut {
		out = append(out, d)
	}
	// Sent in arrival order, so re-dispatched in it.
	slices.SortFunc(out, func(a, b delivery) int { return cmp.Compare(a.msg.Created, b.msg.Created) })
	s.sharedOut = nil
	s.nShared.Store(0)
	for i := 0; i < s.queue.len(); i++ {
		if d := s.queue.at(i); d.group != nil && d.qos > 0 {
			out = append(out, delivery{msg: d.msg, qos: d.qos, group: d.group})
			queued++
		}
	}
	return out, queued
}

// redispatchAll hands group messages left by a member that went away to
// other members, in the background: an ending session must not wait for
// another member's room.
func (b *Broker) redispatchAll(from *session, orphans []delivery) {
	if len(orphans) == 0 {
		return
	}
	b.releases.Add(1)
	go func() {
		defer b.releases.Done()
		for _, d := range orphans {
			b.redispatch(from, d)
		}
	}()
}

// redispatch gives one group message to another member of its group: a
// connected one on this edge, else one on another edge, else the queue of
// a persistent member here. A QoS 2 message is committed to the member it
// went to: it is dropped, and counted.
func (b *Broker) redispatch(from *session, d delivery) {
	if d.qos == 2 {
		b.m.sharedRedispatch.WithLabelValues("qos2_dropped").Inc()
		return
	}
	g := d.group
	if m := b.index.pickOther(g.name, g.filter, from, true); m != nil {
		b.deliverShared(m, d, "local")
		return
	}
	if b.cluster.Peers != nil {
		if key, ok := b.outsideGroup(from, g); ok {
			ctx, cancel := context.WithTimeout(b.stopped, 30*time.Second)
			wait, err := b.cluster.Peers.ForwardShared(ctx, d.msg, key)
			if err == nil && wait != nil {
				err = wait()
			}
			cancel()
			if err == nil {
				b.m.sharedRedispatch.WithLabelValues("forwarded").Inc()
				return
			}
			if !errors.Is(err, ErrNoMember) {
				b.logger.Warn("shared group message not re-dispatched to another edge", "group", g.name, "error", err)
			}
		}
	}
	// Nobody is connected: a persistent member keeps it for when it is.
	m := b.index.pickOther(g.name, g.filter, from, false)
	if m == nil {
		b.m.sharedRedispatch.WithLabelValues("no_member").Inc()
		b.logger.Warn("shared group message dropped: no other member", "group", g.name, "msg_id", msgIDString(d.msg.ID))
		return
	}
	b.deliverShared(m, d, "queued")
}

// deliverShared queues a re-dispatched group message for member m.
func (b *Broker) deliverShared(m *subscription, d delivery, outcome string) {
	r := m.sess.enqueue(delivery{msg: d.msg, qos: min(d.msg.QoS, m.qos), ids: m.ids, group: m.group})
	if r != enqueued {
		b.m.sharedRedispatch.WithLabelValues("refused").Inc()
		return
	}
	b.m.sharedRedispatch.WithLabelValues(outcome).Inc()
}

// outsideGroup names g as other edges know it: the group and its filter in
// the tenant's outside form.
func (b *Broker) outsideGroup(s *session, g *shareGroup) (GroupKey, bool) {
	f, ok := s.scope.ExternalTopic(g.filter)
	if !ok {
		return GroupKey{}, false
	}
	return GroupKey{Name: g.name, Filter: f}, true
}
