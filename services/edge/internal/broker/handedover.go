package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/keelmq/keel/libs/topic"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
)

// handoverSkew is how far apart the clocks of two edges may be for a
// message published before a handover to be told from one published after
// it by its ingress time. Nodes synchronised by NTP are milliseconds apart;
// a message on the wrong side of the margin is relayed, and the new owner
// drops the copy it has already.
const handoverSkew = 100 * time.Millisecond

// handoverSettle is how long a session taken over from a live edge holds
// back the messages that entered the cluster after the takeover, so that
// the ones published before it and relayed by the previous owner (in
// flight to it at the handover) are sent first, in order. A relay later
// than that is sent when it comes (keel_edge_relays_received_total).
const handoverSettle = time.Second

// handoverSettleLanding replaces handoverSettle when the previous owner was
// still storing forwarded frames at the handover (its store was slow or
// failing over): the messages queued behind them on other edges' links
// reach it, and are relayed, only once they are stored. Measured with the
// e2e suite's Redis failover, relays came up to a few seconds late.
const handoverSettleLanding = 5 * time.Second

// defaultHandoverMemory is how long a handed-over session's subscriptions are
// remembered when Config.HandoverMemory is not set: the default bound of a
// forwarded publish.
const defaultHandoverMemory = 30 * time.Second

// handedOver remembers the subscriptions of the persistent sessions this
// edge handed over to other edges (TakeoverEnd), for as long as a message
// routed here before the new owner's routes were in place may still arrive:
// a frame that sat behind slow store writes on a link, for example. Such a
// message matches nothing here any more, while the new owner, not yet routed
// to when it was published, may never have got it: taken here, it would be
// an acknowledged message lost. It is relayed to the new owner instead, for
// the handed-over sessions alone, and counts as taken once the new owner
// took it (DESIGN: takeover; the old owner forwards to the new one). The
// new owner drops a relayed copy of a message it already queued (by msgID).
//
// Only messages that entered the cluster before the handover (by their
// ingress edge's clock, plus handoverSkew) are relayed: one published after
// it was routed with the new owner's routes in place. A publisher's edge
// stops waiting for a message after the forward timeout, so after that
// nothing published before the handover can arrive any more and the entry
// goes.
type handedOver struct {
	memory time.Duration

	mu   sync.Mutex
	subs topic.Trie[*handedSub] // guarded by mu
	// entries in the order added, so by first expiry; guarded by mu. An
	// entry extended since (extendLocked) may expire after later ones,
	// which are then pruned with it: kept longer, never shorter.
	entries []*handedSub
	// bySession holds the entries of entries by session and new owner;
	// guarded by mu.
	bySession map[handedKey][]*handedSub
	// latest is the latest cutoff of a remembered entry (unix nano), 0
	// when none is: a message that entered after it is not looked up.
	latest atomic.Int64
	// gen counts the calls of add; each entry keeps the count of the call
	// that made it (handedSub.gen), so that a delivery tells the entries
	// remembered after it matched its recipients from the others
	// (lateRelays).
	gen atomic.Uint64
}

// handedKey names the entries of one session handed to one edge.
type handedKey struct{ session, to string }

// handedSub is one subscription of a handed-over session.
type handedSub struct {
	filter  string // internal form (a share's inner filter)
	group   string // the share group's name; "" for a plain subscription
	session string // internal client ID
	target  RelayTarget
	// to is the edge the session went to; "" while it is not known (a
	// fenced copy whose owner the coordinator did not name yet): a message
	// for it is then refused, for its sender to send again (resolve).
	to      string
	noLocal bool
	rap     bool
	cutoff  int64 // unix nano: a message that entered before it is relayed
	expires time.Time
	gen     uint64 // handedOver.gen of the add that made it
}

// RelayTarget is one session on another edge that a relayed message is for.
type RelayTarget struct {
	Tenant   string
	ClientID string // in the tenant's outside form
	// Epoch is the one the session was handed over under.
	Epoch  uint64
	QoS    byte
	Retain bool
	SubIDs []int
}

func newHandedOver(memory time.Duration) *handedOver {
	if memory <= 0 {
		memory = defaultHandoverMemory
	}
	return &handedOver{memory: memory}
}

// add remembers the subscriptions of s, handed over at at to edge to under
// epoch, and returns the entries that stand for them (none: s had no
// subscription), for extendEntries. A shared subscription's
// entry serves only a message of its group that this edge was to serve
// and has no member for any more (groupRelays): the edge that routed it
// here chose this edge for the group, so no other member of the group may
// get it.
func (h *handedOver) add(s *session, at time.Time, to string, epoch uint64) []*handedSub {
	cutoff := at.Add(handoverSkew).UnixNano()
	expires := at.Add(h.memory)
	tenant := s.scope.Tenant()
	clientID, _ := s.scope.ExternalClientID(s.id)
	s.mu.Lock()
	subs := make([]*handedSub, 0, len(s.subs))
	for _, x := range s.subs {
		subs = append(subs, &handedSub{filter: x.filter, group: groupName(x), session: s.id, to: to, noLocal: x.noLocal, rap: x.rap,
			target: RelayTarget{Tenant: tenant, ClientID: clientID, Epoch: epoch, QoS: x.qos, SubIDs: x.ids},
			cutoff: cutoff, expires: expires})
	}
	s.mu.Unlock()
	if len(subs) == 0 {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	gen := h.gen.Add(1)
	for _, e := range subs {
		e.gen = gen
	}
	h.pruneLocked(at)
	// Remembered already under this epoch (a fenced copy named twice, or a
	// second fenced copy of the session while the first one's owner is not
	// known): the later cutoff, and the subscriptions it did not have.
	h.extendLocked(s.id, to, epoch, cutoff)
	key := handedKey{s.id, to}
	have := h.bySession[key]
	if h.bySession == nil {
		h.bySession = map[handedKey][]*handedSub{}
	}
	for i, e := range subs {
		if j := slices.IndexFunc(have, e.same); j >= 0 {
			subs[i] = have[j]
			continue
		}
		h.subs.Add(e.filter, e)
		h.entries = append(h.entries, e)
		h.bySession[key] = append(h.bySession[key], e)
	}
	if cutoff > h.latest.Load() {
		h.latest.Store(cutoff)
	}
	return subs
}

// same reports whether x is e's subscription, handed to the same edge
// under the same epoch.
func (e *handedSub) same(x *handedSub) bool {
	return x.filter == e.filter && x.group == e.group && x.to == e.to && x.target.Epoch == e.target.Epoch
}

// resolve names the edge a session remembered with no known owner (added
// with to == "") went to, under epoch: its entries are relayed there from
// now on. With owner "", no other edge took the session, and they go.
func (h *handedOver) resolve(session, owner string, epoch uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	pending := h.bySession[handedKey{session, ""}]
	if len(pending) == 0 {
		return
	}
	delete(h.bySession, handedKey{session, ""})
	cutoff := int64(0)
	for _, e := range pending {
		cutoff = max(cutoff, e.cutoff)
	}
	// Nobody to relay to, or remembered for the owner already (under this
	// epoch; the owner's entries under another stay its own).
	var gone []*handedSub
	if owner == "" {
		gone = pending
	} else {
		key := handedKey{session, owner}
		h.extendLocked(session, owner, epoch, cutoff)
		have := h.bySession[key]
		for _, e := range pending {
			e.to, e.target.Epoch = owner, epoch
			if slices.ContainsFunc(have, e.same) {
				gone = append(gone, e)
				continue
			}
			h.bySession[key] = append(h.bySession[key], e)
		}
	}
	if len(gone) == 0 {
		return
	}
	for _, e := range gone {
		h.subs.Remove(e.filter, e)
	}
	h.entries = slices.DeleteFunc(h.entries, func(e *handedSub) bool { return slices.Contains(gone, e) })
	if len(h.entries) == 0 {
		h.entries = nil
		h.latest.Store(0)
	}
}

// extend moves the cutoff of the remembered entries of session, handed to
// edge to under epoch, to at (plus the skew) if that is later.
func (h *handedOver) extend(session, to string, epoch uint64, at time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.extendLocked(session, to, epoch, at.Add(handoverSkew).UnixNano())
}

// extendEntries moves the cutoff of entries (as add returned them) to at
// (plus the skew) if that is later, wherever they stand now: an entry
// added with no owner may have been given one since (resolve), or have
// gone for the owner's own entry of the same subscription, which is
// extended then.
func (h *handedOver) extendEntries(entries []*handedSub, at time.Time) {
	cutoff := at.Add(handoverSkew).UnixNano()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, e := range entries {
		h.extendLocked(e.session, e.to, e.target.Epoch, cutoff)
	}
}

// extendLocked is extend given the cutoff, and reports whether there were
// any such entries. h.mu must be held.
func (h *handedOver) extendLocked(session, to string, epoch uint64, cutoff int64) bool {
	found := false
	for _, e := range h.bySession[handedKey{session, to}] {
		if e.target.Epoch == epoch {
			found = true
			e.cutoff = max(e.cutoff, cutoff)
			// A message that entered just before the new cutoff can
			// arrive as late after it as one before the first cutoff
			// could: the entry is kept for the memory past it, or such a
			// message would find it pruned and be taken by nobody.
			e.expires = maxTime(e.expires, time.Unix(0, e.cutoff).Add(h.memory))
		}
	}
	if found && cutoff > h.latest.Load() {
		h.latest.Store(cutoff)
	}
	return found
}

// mayRelay is the lock-free first check of relays: false in the common
// case, no handover, or a message newer than every one remembered.
func (h *handedOver) mayRelay(m *Message) bool {
	return m.QoS > 0 && m.Created < h.latest.Load()
}

// relay is the sessions of one edge a message is relayed to.
type relay struct {
	to      string
	targets []RelayTarget
}

// relays returns, by new owner, the handed-over sessions that m must be
// relayed to: it entered the cluster before they were handed over and
// matches their plain subscriptions (one delivery per session, at the
// highest QoS of its matching subscriptions, with all their identifiers,
// as the index merges). A shared subscription's entry is left to
// groupRelays. only, when not nil, limits them to those sessions (m was
// relayed here for them, and they moved on), and then every subscription
// of theirs counts, plain or shared: m is theirs already. QoS 0 is best
// effort and never relayed.
func (h *handedOver) relays(m *Message, now time.Time, only func(session string) bool) []relay {
	var out []relay
	h.eachBefore(m, now, func(e *handedSub) {
		if only == nil && e.group != "" || only != nil && !only(e.session) {
			return
		}
		out = e.appendTo(out, m)
	})
	return out
}

// eachBefore calls each, under h.mu, for every remembered entry m entered
// the cluster before and may go to (not a no-local subscription of m's
// publisher).
func (h *handedOver) eachBefore(m *Message, now time.Time, each func(e *handedSub)) {
	if !h.mayRelay(m) {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.pruneLocked(now)
	h.subs.Match(m.Topic, func(e *handedSub) bool {
		if m.Created < e.cutoff && !(e.noLocal && e.session == m.Origin) {
			each(e)
		}
		return true
	})
}

// lateRelays is relays(m, now, nil) decided again once m was delivered
// here (DeliverForwarded), for recipients here matched at generation gen
// (handedOver.gen read after the match). A session with no known owner is
// left out if its entry was remembered after that (gen above it): its
// copy was still in the index when m was matched (relayFenced remembers
// before it forgets), so it was a recipient here. One remembered before
// was not matched by m when the recipients were decided (m entered after
// its cutoff then) but is now: its cutoff was extended since (the copy's
// routes drew m here after the copy left the index). m reached it nowhere,
// so unknown is set: refused, m is sent again, rather than taken with that
// session missing it.
func (h *handedOver) lateRelays(m *Message, now time.Time, gen uint64) (out []relay, unknown bool) {
	h.eachBefore(m, now, func(e *handedSub) {
		switch {
		case e.group != "":
		case e.to == "":
			unknown = unknown || e.gen <= gen
		default:
			out = e.appendTo(out, m)
		}
	})
	return out, unknown
}

// groupRelays returns, by new owner, one handed-over member of each shared
// group that need names (by group name and inner filter) and m matches,
// which entered the cluster before it was handed over, and those groups.
func (h *handedOver) groupRelays(m *Message, now time.Time, need func(group, filter string) bool) ([]relay, []*shareGroup) {
	if !h.mayRelay(m) {
		return nil, nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.pruneLocked(now)
	var out []relay
	var groups []*shareGroup
	h.subs.Match(m.Topic, func(e *handedSub) bool {
		if e.group == "" || m.Created >= e.cutoff ||
			slices.ContainsFunc(groups, func(g *shareGroup) bool { return g.name == e.group && g.filter == e.filter }) ||
			!need(e.group, e.filter) {
			return true
		}
		groups = append(groups, &shareGroup{name: e.group, filter: e.filter})
		out = e.appendTo(out, m)
		return true
	})
	return out, groups
}

// appendTo adds e's session to the relays of m in out, merged with
// another subscription of it there.
func (e *handedSub) appendTo(out []relay, m *Message) []relay {
	t := e.target
	t.QoS = min(t.QoS, m.QoS)
	t.Retain = m.Retain && e.rap
	i := slices.IndexFunc(out, func(r relay) bool { return r.to == e.to })
	if i < 0 {
		out = append(out, relay{to: e.to})
		i = len(out) - 1
	}
	r := &out[i]
	j := slices.IndexFunc(r.targets, func(x RelayTarget) bool { return x.Tenant == t.Tenant && x.ClientID == t.ClientID })
	if j < 0 {
		r.targets = append(r.targets, t)
		return out
	}
	x := &r.targets[j]
	x.QoS = max(x.QoS, t.QoS)
	x.Retain = x.Retain || t.Retain
	x.SubIDs = append(slices.Clip(x.SubIDs), t.SubIDs...)
	return out
}

// pruneLocked forgets the entries expired at now. h.mu must be held.
func (h *handedOver) pruneLocked(now time.Time) {
	n := 0
	for n < len(h.entries) && !now.Before(h.entries[n].expires) {
		e := h.entries[n]
		h.subs.Remove(e.filter, e)
		key := handedKey{e.session, e.to}
		if rest := slices.DeleteFunc(h.bySession[key], func(x *handedSub) bool { return x == e }); len(rest) > 0 {
			h.bySession[key] = rest
		} else {
			delete(h.bySession, key)
		}
		h.entries[n] = nil
		n++
	}
	if n == 0 {
		return
	}
	h.entries = h.entries[n:]
	if len(h.entries) == 0 {
		h.entries = nil
		h.latest.Store(0)
	}
}

// errNoRelay is returned when a message must be relayed to a handed-over
// session but this edge has no peers to relay through.
var errNoRelay = errors.New("message for a handed-over session, and no link to its new owner")

// errOwnerUnknown is returned when a message must be relayed to a session
// whose fenced copy left this edge before the coordinator named its owner.
var errOwnerUnknown = errors.New("message for a session fenced here whose owner is not known yet")

// handedRelays is where a forwarded message goes besides this edge's
// recipients, for the sessions this edge handed over before it entered
// the cluster (see handedOver).
type handedRelays struct {
	// groups relays it, for each shared group this edge was to serve for
	// it and gave no member here, to one member of the group this edge
	// handed over: the edge that routed it here chose this edge for the
	// group, because of that member's routes, and taken here it would
	// reach no member of it. relayed is those groups.
	groups  []relay
	relayed []*shareGroup
	// plain relays it to the sessions whose plain subscriptions it
	// matches: their new owners may not have been routed to.
	plain []relay
}

// handedRelaysFor decides the relays of forwarded message m, given the
// shared groups served here (served) and the choice its sender made
// (shared). errOwnerUnknown when one is for a session whose owner is not
// known yet (ownerKnown).
func (b *Broker) handedRelaysFor(m *Message, shared SharedChoice, served []*shareGroup) (handedRelays, error) {
	var r handedRelays
	if !b.handed.mayRelay(m) {
		return r, nil
	}
	now := time.Now()
	serves := b.servesGroup(m, shared) // nil: every group here
	r.groups, r.relayed = b.handed.groupRelays(m, now, func(group, filter string) bool {
		if slices.ContainsFunc(served, func(g *shareGroup) bool { return g.name == group && g.filter == filter }) {
			return false
		}
		return serves == nil || serves(&shareGroup{name: group, filter: filter})
	})
	if !shared.Only {
		r.plain = b.handed.relays(m, now, nil)
	}
	if err := b.ownerKnown(r.groups, r.plain); err != nil {
		return handedRelays{}, err
	}
	return r, nil
}

// ownerKnown returns errOwnerUnknown when one of the relays is for a
// session whose owner is not known yet. The message must then not be taken
// here, where it would be taken by nobody: the sender sends it again, and
// by then the owner may be known (relayFenced). Decided before anyone here
// gets the message, so that each gets it once however often it is sent.
//
// NOTE(edge): the refusal fails the frame, and the sender's link resends
// it and every frame behind it, other sessions' too, until the owner is
// known. The window is short: the owner is looked up before the copy
// goes, also when the CONNECT that made the copy ran out of time
// (relayFenced), and then again every two seconds at most; it stays open
// only while the coordinator does not answer, and an edge that cannot
// reach the coordinator loses its lease within its TTL, fences itself and
// rejoins, and its senders route what they held again. A refusal of the
// one message (ForwardResponse.refusals, in the protocol but implemented
// by neither side) would not hold up the link, but an edge of an earlier
// version ignores refusals and would count the message taken: a sender
// must first say that it honours them (a ForwardRequest field).
func (b *Broker) ownerKnown(rss ...[]relay) error {
	for _, rs := range rss {
		if slices.ContainsFunc(rs, func(r relay) bool { return r.to == "" }) {
			b.m.handoverRelays.WithLabelValues("owner_unknown").Inc()
			return errOwnerUnknown
		}
	}
	return nil
}

// relayTo relays m as rs says and returns once the new owners took it.
// Every owner in rs is known (ownerKnown).
func (b *Broker) relayTo(ctx context.Context, m *Message, rs []relay) error {
	if len(rs) == 0 {
		return nil
	}
	if b.cluster.Peers == nil {
		b.m.handoverRelays.WithLabelValues("error").Inc()
		return errNoRelay
	}
	waits := make([]func() error, 0, len(rs))
	var failed error
	for _, r := range rs {
		wait, err := b.cluster.Peers.Relay(ctx, m, r.to, r.targets)
		if err != nil {
			failed = errors.Join(failed, fmt.Errorf("relay to %s: %w", r.to, err))
			continue
		}
		waits = append(waits, wait)
	}
	for _, wait := range waits {
		if err := wait(); err != nil {
			failed = errors.Join(failed, err)
		}
	}
	if failed != nil {
		b.m.handoverRelays.WithLabelValues("error").Inc()
		b.logger.Warn("message for a handed-over session not relayed to its new owner; not taken", "topic", m.Topic, "error", failed)
		return failed
	}
	b.m.handoverRelays.WithLabelValues("ok").Inc()
	b.logger.Debug("message published before a handover relayed to the new owner", "topic", m.Topic, "edges", len(rs))
	return nil
}

// DeliverRelayed takes a message relayed by the edge that handed the target
// sessions over to this one: it goes to them alone, and a session that has
// the message already (it reached this edge directly too) does not get it
// twice. A session that moved on from here meanwhile gets it relayed again;
// one that ended here gets nothing.
func (b *Broker) DeliverRelayed(ctx context.Context, pm *commonv1.Message, targets []RelayTarget) error {
	m, err := b.fromProto(pm)
	if err != nil {
		return err
	}
	var failed error
	var movedOn map[string]bool
	var here []*session
	var to []RelayTarget // of the sessions in here
	for _, t := range targets {
		sc, err := b.scope(t.Tenant)
		if err != nil || t.Tenant != pm.GetTenant() {
			return fmt.Errorf("relayed message: session of tenant %q for a message of tenant %q", t.Tenant, pm.GetTenant())
		}
		id := sc.ClientID(t.ClientID)
		s := b.session(id)
		if s == nil && b.unfinishedTakeover(id, "") != "" {
			// Owned here but held elsewhere (a takeover failed): the
			// message would reach no copy. The sender tries again.
			failed = fmt.Errorf("relayed message for session %s, owned here but still held by another edge", t.ClientID)
			continue
		}
		if s == nil && b.connecting(id, t.Epoch) {
			// Claimed here for a connection, its copy not made yet: taken
			// as moved on, the message would reach no copy. The sender
			// tries again.
			failed = fmt.Errorf("relayed message for session %s, whose connection here is still taking it", t.ClientID)
			continue
		}
		if s == nil {
			if movedOn == nil {
				movedOn = map[string]bool{}
			}
			movedOn[id] = true
			continue
		}
		s.mu.Lock()
		older := s.epoch < t.Epoch
		s.mu.Unlock()
		if older {
			// The handover under t.Epoch has not reached this edge's copy:
			// not the session meant; the sender tries again.
			failed = fmt.Errorf("relayed message for session %s under epoch %d, held here under an older one", t.ClientID, t.Epoch)
			continue
		}
		here, to = append(here, s), append(to, t)
	}
	if failed != nil {
		// Sent again, it goes to every target then: none gets it now.
		return failed
	}
	// Those that moved on get it relayed again; decided before the
	// sessions here get it (ownerKnown).
	var onward []relay
	if movedOn != nil && b.handed.mayRelay(m) {
		onward = b.handed.relays(m, time.Now(), func(session string) bool { return movedOn[session] })
		if err := b.ownerKnown(onward); err != nil {
			return err
		}
	}
	for i, s := range here {
		t := to[i]
		if err := b.counted(s.enqueue(delivery{msg: m, qos: min(m.QoS, t.QoS), retain: t.Retain, ids: t.SubIDs, relayed: true})); err != nil {
			failed = err
		}
	}
	if failed != nil {
		return failed
	}
	return b.relayTo(ctx, m, onward)
}
