package forward

import (
	"cmp"
	"context"
	"slices"
	"sync"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/services/edge/internal/broker"
)

// Ownership of forwarded QoS 1 group messages (DESIGN: shared
// subscriptions). The sending edge asks for a report (SharedTarget.report)
// and keeps the message on the link, in held, until the receiver reports
// what became of it: acknowledged, refused, or the member gone. A refused or
// orphaned message is re-dispatched by the sender; so is every message the
// receiver had taken and not yet reported when the receiver leaves the
// membership (it died, or its lease lapsed). The receiver numbers its
// outcomes per sending incarnation and sends them again on each new stream
// until the sender confirms them, so none is lost to a broken stream; a
// repeated one finds nothing held and does nothing.

// heldKey names a group message a link keeps.
type heldKey struct {
	id            broker.MsgID
	group, filter string
}

func heldKeyOf(id *commonv1.MsgID, group, filter string) heldKey {
	return heldKey{id: broker.MsgID{Edge: id.GetEdgeId(), Incarnation: id.GetIncarnation(), Seq: id.GetSeq()}, group: group, filter: filter}
}

// heldMsg is a group message kept until its outcome is reported.
type heldMsg struct {
	msg   *commonv1.Message
	group broker.GroupKey
	taken bool // the peer took the frame that carried it
}

// hold marks the shared targets of fm for a report and returns their keys.
func hold(fm *edgev1.ForwardMessage) []heldKey {
	keys := make([]heldKey, 0, len(fm.GetShared()))
	for _, t := range fm.GetShared() {
		t.Report = true
		keys = append(keys, heldKeyOf(fm.GetMessage().GetId(), t.GetGroup(), t.GetFilter()))
	}
	return keys
}

// keepLocked records what p's message leaves held on the link. l.mu must be
// held. Past the bound, the message goes unkept: a peer that reports
// nothing (an edge of an earlier version), or far less than it takes, must
// not make this edge keep messages without end.
func (l *Link) keepLocked(p *pending) {
	if len(p.held) == 0 {
		return
	}
	if len(l.held) >= cmp.Or(l.maxHeld, defaultMaxHeldPerPeer) {
		for _, t := range p.msg.GetShared() {
			t.Report = false
		}
		p.held = nil
		l.m.sharedUnkept.Inc()
		return
	}
	if l.held == nil {
		l.held = map[heldKey]*heldMsg{}
	}
	for _, k := range p.held {
		if _, ok := l.held[k]; !ok {
			l.m.sharedHeld.Inc()
		}
		l.held[k] = &heldMsg{msg: p.msg.GetMessage(), group: broker.GroupKey{Name: k.group, Filter: k.filter}}
	}
}

// outcomes acts on reported outcomes: a message acknowledged is forgotten,
// one refused or orphaned is re-dispatched elsewhere. Repeats (a stream
// broke before the sender's confirmation) find nothing held.
func (l *Link) outcomes(outs []*edgev1.SharedOutcome) {
	if len(outs) == 0 {
		return
	}
	var again []*heldMsg
	l.mu.Lock()
	for _, o := range outs {
		k := heldKeyOf(o.GetMsgId(), o.GetGroup(), o.GetFilter())
		if h, ok := l.held[k]; ok {
			delete(l.held, k)
			l.m.sharedHeld.Dec()
			if o.GetKind() != edgev1.SharedOutcomeKind_SHARED_OUTCOME_KIND_ACKED {
				again = append(again, h)
			}
		}
		l.m.sharedOutcomes.WithLabelValues(outcomeLabel(o.GetKind())).Inc()
		l.confirm = max(l.confirm, o.GetSeq())
	}
	l.mu.Unlock()
	l.redispatch(again)
	select {
	case l.wake <- struct{}{}: // to confirm them
	default:
	}
}

// redispatch hands held messages to the Forwarder's re-dispatch, never to
// this link's peer: in the background, one at a time, in the order given.
func (l *Link) redispatch(hs []*heldMsg) {
	if len(hs) == 0 {
		return
	}
	if l.again == nil {
		l.m.sharedAbandoned.Add(float64(len(hs)))
		return
	}
	l.againMu.Lock()
	l.againQueue = append(l.againQueue, hs...)
	start := !l.againBusy
	l.againBusy = true
	l.againMu.Unlock()
	if !start {
		return
	}
	go func() {
		for {
			l.againMu.Lock()
			next := l.againQueue
			l.againQueue = nil
			if len(next) == 0 {
				l.againBusy = false
				l.againMu.Unlock()
				return
			}
			l.againMu.Unlock()
			for _, h := range next {
				l.again(h.msg, h.group, l.peer)
			}
		}
	}()
}

// releaseHeldLocked ends what a failing link holds. Messages the peer never
// took are the publishers' to send again (they were not acknowledged).
// Those it took are re-dispatched when the peer left the membership;
// otherwise the peer still delivers them (this edge's own incarnation
// changed, or it stops) and they are given up. l.mu must be held.
func (l *Link) releaseHeldLocked() (again []*heldMsg) {
	for _, h := range l.held {
		if h.taken && l.gone.Load() {
			again = append(again, h)
		} else if h.taken {
			l.m.sharedAbandoned.Inc()
		}
	}
	l.m.sharedHeld.Sub(float64(len(l.held)))
	l.held = nil
	// In the order they entered the cluster, as their publishers sent them.
	slices.SortStableFunc(again, func(a, b *heldMsg) int {
		return cmp.Compare(a.msg.GetIngressUnixNano(), b.msg.GetIngressUnixNano())
	})
	return again
}

func outcomeLabel(k edgev1.SharedOutcomeKind) string {
	switch k {
	case edgev1.SharedOutcomeKind_SHARED_OUTCOME_KIND_ACKED:
		return "acked"
	case edgev1.SharedOutcomeKind_SHARED_OUTCOME_KIND_REFUSED:
		return "refused"
	case edgev1.SharedOutcomeKind_SHARED_OUTCOME_KIND_MEMBER_GONE:
		return "member_gone"
	}
	return "unknown"
}

// The receiving side.

// outcome is one report waiting for the sender's confirmation.
type outcome struct {
	pb *edgev1.SharedOutcome
	// msg and group, for an outcome that asks the sender to re-dispatch:
	// this edge re-dispatches the message itself if the sender goes first.
	msg   *commonv1.Message
	group broker.GroupKey
}

// outbox holds the outcomes for one sending incarnation.
type outbox struct {
	mu      sync.Mutex
	last    uint64    // seq of the last outcome queued
	pending []outcome // not yet confirmed, in seq order
	sent    uint64    // highest seq sent on the current stream
	stream  uint64    // the stream that sends them
	wake    chan struct{}
}

// maxOutbox bounds the outcomes waiting for one sender; past it this edge
// re-dispatches orphans itself.
const maxOutbox = 1 << 16

func kindOf(o broker.ShareOutcome) edgev1.SharedOutcomeKind {
	switch o {
	case broker.ShareAcked:
		return edgev1.SharedOutcomeKind_SHARED_OUTCOME_KIND_ACKED
	case broker.ShareRefused:
		return edgev1.SharedOutcomeKind_SHARED_OUTCOME_KIND_REFUSED
	default:
		return edgev1.SharedOutcomeKind_SHARED_OUTCOME_KIND_MEMBER_GONE
	}
}

// ReportShared implements broker.SharedReports: the outcome goes to the
// origin on its forward stream, now or when it next opens one.
func (s *Server) ReportShared(to broker.ShareOrigin, m *broker.Message, group broker.GroupKey, o broker.ShareOutcome) bool {
	if s.Members != nil {
		if inc, ok := s.Members.Incarnation(to.Edge); !ok || inc != to.Incarnation {
			return false
		}
	}
	ob := s.outbox(peerKey{to.Edge, to.Incarnation})
	out := outcome{pb: &edgev1.SharedOutcome{MsgId: &commonv1.MsgID{EdgeId: m.ID.Edge, Incarnation: m.ID.Incarnation, Seq: m.ID.Seq},
		Group: group.Name, Filter: group.Filter, Kind: kindOf(o)}}
	if o != broker.ShareAcked {
		out.msg, out.group = m.Proto(), group
	}
	ob.mu.Lock()
	if len(ob.pending) >= maxOutbox {
		ob.mu.Unlock()
		return false
	}
	ob.last++
	out.pb.Seq = ob.last
	ob.pending = append(ob.pending, out)
	ob.mu.Unlock()
	select {
	case ob.wake <- struct{}{}:
	default:
	}
	return true
}

// outbox returns the outbox of a sending incarnation, made on first use.
func (s *Server) outbox(k peerKey) *outbox {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.outboxes == nil {
		s.outboxes = map[peerKey]*outbox{}
	}
	ob := s.outboxes[k]
	if ob == nil {
		ob = &outbox{wake: make(chan struct{}, 1)}
		s.outboxes[k] = ob
	}
	return ob
}

// confirmed forgets the outcomes up to seq.
func (ob *outbox) confirmed(seq uint64) {
	ob.mu.Lock()
	defer ob.mu.Unlock()
	n := 0
	for n < len(ob.pending) && ob.pending[n].pb.GetSeq() <= seq {
		n++
	}
	ob.pending = ob.pending[n:]
}

// takeOutcomes makes the stream whose first frame just arrived the one
// that sends ob's outcomes, and returns its generation for sendOutcomes.
// It is called on the stream's handler, not on the goroutine that sends:
// two streams' senders may start in either order, and the newer stream
// must win.
func (ob *outbox) takeOutcomes() uint64 {
	ob.mu.Lock()
	defer ob.mu.Unlock()
	ob.stream++
	ob.sent = 0
	return ob.stream
}

// sendOutcomes sends ob's outcomes on the stream of generation gen
// (takeOutcomes) until ctx ends or a newer stream takes over: first every
// unconfirmed one, then each as it comes.
func (s *Server) sendOutcomes(ctx context.Context, ob *outbox, gen uint64, send func(*edgev1.ForwardResponse) error) {
	for {
		ob.mu.Lock()
		if ob.stream != gen {
			ob.mu.Unlock()
			// The wake that brought this sender here may have been meant
			// for the newer stream's: pass it on.
			select {
			case ob.wake <- struct{}{}:
			default:
			}
			return
		}
		var outs []*edgev1.SharedOutcome
		for _, o := range ob.pending {
			if o.pb.GetSeq() > ob.sent {
				outs = append(outs, o.pb)
			}
		}
		ob.mu.Unlock()
		if len(outs) > 0 {
			if err := send(&edgev1.ForwardResponse{SharedOutcomes: outs}); err != nil {
				return
			}
			ob.mu.Lock()
			if ob.stream == gen {
				ob.sent = max(ob.sent, outs[len(outs)-1].GetSeq())
			}
			ob.mu.Unlock()
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-ob.wake:
		}
	}
}

// PeerGone forgets the outcomes waiting for an edge incarnation that left
// the membership. The messages they gave back are re-dispatched here: the
// edge that kept them will not.
func (s *Server) PeerGone(edgeID string) {
	var live uint64
	ok := false
	if s.Members != nil {
		live, ok = s.Members.Incarnation(edgeID)
	}
	var orphans []outcome
	s.mu.Lock()
	for k, ob := range s.outboxes {
		if k.edge != edgeID || (ok && k.incarnation == live) {
			continue
		}
		delete(s.outboxes, k)
		ob.mu.Lock()
		for _, o := range ob.pending {
			if o.msg != nil {
				orphans = append(orphans, o)
			}
		}
		ob.pending = nil
		ob.stream++ // ends its sender
		ob.mu.Unlock()
		select {
		case ob.wake <- struct{}{}:
		default:
		}
	}
	s.mu.Unlock()
	if len(orphans) == 0 {
		return
	}
	s.log().Info("edge left with group messages to re-dispatch; re-dispatching them here", "edge", edgeID, "messages", len(orphans))
	go func() {
		for _, o := range orphans {
			s.Deliver.RedispatchShared(o.msg, o.group, edgeID)
		}
	}()
}
