package forward

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/keelmq/keel/libs/tracing"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Peer is another edge and the URL of its edge API.
type Peer struct {
	ID  string
	URL string
	// Incarnation is the edge's incarnation in the membership the route
	// was resolved with (0: not known).
	Incarnation uint64
}

// Resolver answers which edges have routes matching a topic.
type Resolver interface {
	Route(ctx context.Context, tenant, topic string) (Route, error)
}

// LocalResolver is a Resolver that can answer a topic from what it holds:
// held is false when the answer needs a call.
type LocalResolver interface {
	RouteAtOnce(tenant, topic string) (route Route, held bool, err error)
}

// Route is where a message must go: the edges with matching plain
// subscriptions, and per matching shared group the edges with members.
type Route struct {
	Edges  []Peer
	Groups []GroupRoute
	// Unsettled: the router is settling a membership change and may have
	// missed routes. Edges is then every live edge, and the groups are not
	// chosen from Groups: every edge serves each matching group it has
	// members of (a group with members on several edges gets one copy on
	// each for the while, none missed).
	Unsettled bool
}

// GroupRoute is one shared group and the edges with members of it.
type GroupRoute struct {
	Name, Filter string // filter in the tenant's outside form
	Edges        []Peer
}

// Forwarder sends messages published on this edge to the peers with
// matching routes, one [Link] per peer.
type Forwarder struct {
	Self string
	// Incarnation is this edge's current incarnation. Links are made under
	// one incarnation: after the edge rejoins under a new one, its links
	// are replaced, and what the old ones still held fails (a fenced edge
	// acknowledged none of it), because peers refuse the old incarnation.
	Incarnation func() uint64
	Resolver    Resolver
	// URLs finds the edges that messages are relayed to (Relay); nil:
	// this edge relays nothing.
	URLs URLs
	// Bound is how long a QoS 1/2 publish waits for its peers before the
	// publisher is closed without an acknowledgement (DESIGN: PUBLISH).
	Bound time.Duration
	// Redispatch gives a QoS 1 group message kept for a member on another
	// edge to another member, when that member or its edge goes first (nil:
	// group messages are not kept once the peer took them).
	Redispatch func(m *commonv1.Message, group broker.GroupKey, notEdge string)
	// MaxHeldPerPeer bounds the group messages kept for one peer (0: a
	// default of 131072); past it they are forwarded unkept.
	MaxHeldPerPeer int
	Logger         *slog.Logger
	Metrics        *Metrics // nil: not exported

	mu    sync.RWMutex
	ctx   context.Context
	links map[string]*Link
	wg    sync.WaitGroup
	turns sync.Map // shared group → *atomic.Uint64, whose turn it is
}

// Run serves the links until ctx ends.
func (f *Forwarder) Run(ctx context.Context) error {
	f.mu.Lock()
	f.ctx = ctx
	f.mu.Unlock()
	<-ctx.Done()
	f.wg.Wait()
	return nil
}

func (f *Forwarder) link(p Peer) (*Link, error) {
	// Every forwarded message asks for its links: the usual answer, a live
	// link of this incarnation, is read under the read lock.
	inc := f.Incarnation()
	f.mu.RLock()
	l, running := f.links[p.ID], f.ctx != nil && f.ctx.Err() == nil
	f.mu.RUnlock()
	if running && l != nil && l.incarnation == inc && !l.isClosed() && !restarted(l, p) {
		return l, nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ctx == nil || f.ctx.Err() != nil {
		return nil, fmt.Errorf("%w: forwarder not running", ErrPeerGone)
	}
	if f.links == nil {
		f.links = map[string]*Link{}
	}
	l = f.links[p.ID]
	if l != nil && l.incarnation != inc {
		l.stop()
		l = nil
	}
	if l != nil && restarted(l, p) {
		// What the link holds was for the peer's earlier incarnation.
		l.gone.Store(true)
		l.stop()
		l = nil
	}
	if l == nil || l.isClosed() {
		l = NewLink(f.Self, inc, p.ID, p.URL, f.log(), f.Metrics)
		l.again, l.maxHeld, l.target = f.Redispatch, f.MaxHeldPerPeer, p.Incarnation
		f.links[p.ID] = l
		ctx, cancel := context.WithCancel(f.ctx)
		l.stop = cancel
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer cancel()
			_ = l.Run(ctx)
		}()
	}
	return l, nil
}

// incarnations is what URLs may also tell: the incarnation of each live
// edge (cluster.Peers does).
type incarnations interface {
	Incarnation(edgeID string) (uint64, bool)
}

// restarted reports whether p names a newer incarnation of the peer than
// the one l was made for.
func restarted(l *Link, p Peer) bool {
	return p.Incarnation > l.target && l.target != 0
}

// Links reports the links to peers made so far, sorted by peer. It only
// reads: no link is made or replaced.
func (f *Forwarder) Links() []LinkStatus {
	f.mu.Lock()
	links := make([]*Link, 0, len(f.links))
	for _, l := range f.links {
		links = append(links, l)
	}
	f.mu.Unlock()
	out := make([]LinkStatus, 0, len(links))
	for _, l := range links {
		out = append(out, l.Status())
	}
	slices.SortFunc(out, func(a, b LinkStatus) int { return strings.Compare(a.Peer, b.Peer) })
	return out
}

// PeerGone fails at once what waits on the link to an edge that left the
// membership: its lease expired, so it fenced itself and acknowledges
// nothing more. The publishers waiting on it are closed without an
// acknowledgement now, and send again (to the sessions' new holders), rather
// than at the end of the forward bound.
func (f *Forwarder) PeerGone(edgeID string) {
	live, isLive := uint64(0), false
	if m, ok := f.URLs.(incarnations); ok {
		live, isLive = m.Incarnation(edgeID)
	}
	f.mu.Lock()
	l := f.links[edgeID]
	if l != nil && isLive && l.target != 0 && l.target == live {
		// Made for the incarnation that replaced the one that left.
		f.mu.Unlock()
		return
	}
	delete(f.links, edgeID)
	f.mu.Unlock()
	if l != nil {
		f.log().Info("peer edge left the membership; failing what waits for it", "peer", edgeID)
		l.gone.Store(true)
		l.stop()
	}
}

// Forward implements broker.Peers: m is queued on the link of every peer
// with a matching route before it returns, so a publisher's messages reach
// each peer in order; the wait is bounded from this call on. Each shared
// group is served by one of the edges with members, in turn, so that one
// member in the whole cluster gets the message; local says which groups
// this edge serves. Routed again (again set), m goes to every peer with a
// match for the sessions routable there since again.Since, and to the
// groups in again.Groups alone.
func (f *Forwarder) Forward(ctx context.Context, m *broker.Message, again *broker.Again) (func() error, broker.SharedChoice, error) {
	tenant, topic, ok := tenancy.TenantOfTopic(m.Topic)
	if !ok {
		return nil, broker.SharedChoice{}, nil
	}
	// Read once per message, and only for QoS 1/2: nobody waits for QoS 0.
	var deadline time.Time
	if m.QoS > 0 {
		deadline = time.Now().Add(f.bound())
	}
	route, err := f.route(ctx, tenant, topic)
	if err != nil {
		return nil, broker.SharedChoice{}, err
	}
	// Routed again, a message goes to the groups the first routing chose.
	everyGroup := route.Unsettled && again == nil
	if again != nil && route.Unsettled {
		// Each group owed a member must be given one now, by an edge the
		// answer names; an unsettled answer may name none where there are
		// members. Nothing is sent until every group has an edge.
		if k, ok := unknownGroup(again.Groups, route.Groups); ok {
			return nil, broker.SharedChoice{}, fmt.Errorf("%w: group %s of %s", broker.ErrRoutesUnsettled, k.Name, k.Filter)
		}
	}
	local := broker.SharedChoice{Chosen: !everyGroup}
	if again != nil {
		local.Since = again.Since
	}
	// Most messages go to a few edges: the destinations stay on the stack.
	var buf [8]dest
	dests := buf[:0]
	for _, p := range route.Edges {
		if p.ID != f.Self {
			dests, _ = destFor(dests, p)
		}
	}
	groups := route.Groups
	if everyGroup {
		groups = nil // each edge serves its own members
		owedBy(dests, route.Groups, f.Self)
	}
	for _, g := range groups {
		if again != nil && !slices.Contains(again.Groups, broker.GroupKey{Name: g.Name, Filter: g.Filter}) {
			continue // served the first time
		}
		p := f.pickFor(m, tenant, g)
		if p.ID == f.Self {
			local.Groups = append(local.Groups, broker.GroupKey{Name: g.Name, Filter: g.Filter})
			continue
		}
		var i int
		dests, i = destFor(dests, p)
		dests[i].shared = append(dests[i].shared, &edgev1.SharedTarget{Group: g.Name, Filter: g.Filter})
	}
	if len(dests) == 0 {
		return nil, local, nil
	}
	// QoS 0 is best effort across edges too: nobody waits for it.
	wait := m.QoS > 0
	// A plain message is encoded once for every peer; one with shared
	// targets, routed again or traced gets a struct per peer.
	var pm *commonv1.Message
	var raw []byte
	if again == nil && m.Span() == nil && !everyGroup {
		// Held by the links until the peer took it; a QoS 0 message is
		// copied into each link's run (sendPlain), from a buffer reused.
		var buf []byte
		if !wait {
			scratch := plainScratch.Get().(*[]byte)
			defer putPlainScratch(scratch, &raw)
			buf = (*scratch)[:0]
		}
		var ok bool
		if raw, ok = appendForwardMessage(buf, m); !ok {
			raw = nil
		}
	}
	var tk *taking
	if wait {
		tk = &taking{ctx: ctx, deadline: deadline, bound: f.bound(), m: m}
		tk.sent = tk.first[:0]
		m.Forwarding(len(dests))
	}
	for _, d := range dests {
		l, err := f.link(d.peer)
		if err != nil {
			return nil, broker.SharedChoice{}, err
		}
		if raw != nil && len(d.shared) == 0 {
			if !wait {
				l.sendPlain(raw, len(m.Payload))
				continue
			}
			p := tk.next()
			p.raw, p.size = raw, len(m.Payload)
			l.send(p)
			continue
		}
		if pm == nil {
			pm = m.Proto()
		}
		var p *pending
		if wait {
			p = tk.next()
		} else {
			p = new(pending)
		}
		p.msg, p.owes = &edgev1.ForwardMessage{Message: pm, Shared: d.shared, SharedChosen: !everyGroup}, d.owes
		if again != nil {
			p.msg.SessionsSinceUnixNano = again.Since
		}
		p.held = f.hold(m, p.msg)
		if parent := m.Span(); parent != nil {
			// Traced: a forward span per peer, until the peer took it, whose
			// context travels in the frame for the peer's deliver span.
			_, p.span = tracer.Start(trace.ContextWithSpan(context.Background(), parent), "forward",
				trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrPeer.String(d.peer.ID)))
			p.msg.Traceparent = tracing.Traceparent(p.span.SpanContext())
		}
		l.send(p)
	}
	if !wait {
		return nil, local, nil
	}
	return tk.wait, local, nil
}

// taking is what a QoS 1/2 publish waits for: its copies sent to peers,
// until each peer took its own. It holds the first copy's pending too: a
// publish most often goes to one peer, and then costs one allocation here
// where the pending, the list and the wait's closure took three.
type taking struct {
	ctx      context.Context
	deadline time.Time
	bound    time.Duration
	m        *broker.Message
	one      pending
	first    [1]*pending
	sent     []*pending
}

// next returns the pending of the next copy, among those waited for; it
// waits for its outcome and reports it to the message too
// (broker.Message.Forwarding).
func (t *taking) next() *pending {
	p := &t.one
	if len(t.sent) > 0 {
		p = new(pending)
	}
	p.waits, p.forwarded = true, t.m
	t.sent = append(t.sent, p)
	return p
}

func (t *taking) wait() error { return waitTaken(t.ctx, t.deadline, t.bound, t.sent) }

// route resolves where a message on (tenant, topic) goes; under
// broker.AtOnce, only from what the resolver holds (else
// broker.ErrNeedsLookup). No per-message deadline: a held answer needs
// none, and the router client bounds its own lookups.
func (f *Forwarder) route(ctx context.Context, tenant, topic string) (Route, error) {
	if lr, ok := f.Resolver.(LocalResolver); ok && broker.IsAtOnce(ctx) {
		route, held, err := lr.RouteAtOnce(tenant, topic)
		if err != nil {
			return Route{}, fmt.Errorf("resolve routes: %w", err)
		}
		if !held {
			return Route{}, broker.ErrNeedsLookup
		}
		return route, nil
	}
	route, err := f.Resolver.Route(ctx, tenant, topic)
	if err != nil {
		return Route{}, fmt.Errorf("resolve routes: %w", err)
	}
	return route, nil
}

// waitTaken waits until every peer took its copy of a message, or deadline.
// When only peers that left the cluster failed, the error is a
// [*broker.NotTaken] naming the groups they were to serve: a peer that did
// not take the message committed it to no member, and what the link kept
// of it is not re-dispatched (that is for messages a peer took).
func waitTaken(ctx context.Context, deadline time.Time, bound time.Duration, sent []*pending) error {
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	var left *broker.NotTaken
	var owed, served []broker.GroupKey // by their own members (unsettled routes)
	for _, p := range sent {
		// Under load the peer most often took it before the wait began: no
		// timer then.
		err := p.waitOutcome(ctx, deadline, bound, &t)
		if err == nil {
			served = append(served, p.owes...)
			continue
		}
		if !errors.Is(err, broker.ErrEdgeLeft) {
			return err
		}
		if left == nil {
			left = &broker.NotTaken{Err: err}
		}
		for _, g := range p.msg.GetShared() {
			left.Groups = append(left.Groups, broker.GroupKey{Name: g.GetGroup(), Filter: g.GetFilter()})
		}
		owed = append(owed, p.owes...)
	}
	if left != nil {
		for _, g := range owed {
			if !slices.Contains(served, g) && !slices.Contains(left.Groups, g) {
				left.Groups = append(left.Groups, g)
			}
		}
		return left
	}
	return nil
}

// ForwardShared implements broker.Peers: m goes to one other edge with
// members of group (not notEdge), for that group only. The wait is bounded
// as Forward's.
func (f *Forwarder) ForwardShared(ctx context.Context, m *broker.Message, group broker.GroupKey, notEdge string) (func() error, error) {
	tenant, topic, ok := tenancy.TenantOfTopic(m.Topic)
	if !ok {
		return nil, broker.ErrNoMember
	}
	bound := f.bound()
	deadline := time.Now().Add(bound)
	route, err := f.Resolver.Route(ctx, tenant, topic)
	if err != nil {
		return nil, fmt.Errorf("resolve routes: %w", err)
	}
	var others GroupRoute
	for _, g := range route.Groups {
		if g.Name == group.Name && g.Filter == group.Filter {
			others = GroupRoute{Name: g.Name, Filter: g.Filter,
				Edges: slices.DeleteFunc(slices.Clone(g.Edges), func(p Peer) bool { return p.ID == f.Self || p.ID == notEdge })}
		}
	}
	if len(others.Edges) == 0 {
		if route.Unsettled {
			return nil, fmt.Errorf("%w: group %s of %s", broker.ErrRoutesUnsettled, group.Name, group.Filter)
		}
		return nil, broker.ErrNoMember
	}
	l, err := f.link(f.pick(tenant, others))
	if err != nil {
		return nil, err
	}
	p := &pending{msg: &edgev1.ForwardMessage{Message: m.Proto(), SharedChosen: true, SharedOnly: true,
		Shared: []*edgev1.SharedTarget{{Group: group.Name, Filter: group.Filter}}}}
	p.held = f.hold(m, p.msg)
	p.waits = true
	l.send(p)
	return func() error { return waitOne(ctx, deadline, bound, p) }, nil
}

// Relay implements broker.Peers: m goes to edge for the sessions in to
// alone. The wait is bounded as Forward's.
func (f *Forwarder) Relay(ctx context.Context, m *broker.Message, edge string, to []broker.RelayTarget) (func() error, error) {
	if f.URLs == nil {
		return nil, fmt.Errorf("%w: no way to find edge %s", ErrPeerGone, edge)
	}
	url, ok := f.URLs.URL(edge)
	if !ok {
		return nil, fmt.Errorf("%w: %s is not a live member", ErrPeerGone, edge)
	}
	bound := f.bound()
	deadline := time.Now().Add(bound)
	p := Peer{ID: edge, URL: url}
	if m, ok := f.URLs.(incarnations); ok {
		p.Incarnation, _ = m.Incarnation(edge)
	}
	l, err := f.link(p)
	if err != nil {
		return nil, err
	}
	fm := &edgev1.ForwardMessage{Message: m.Proto(), Sessions: make([]*edgev1.SessionTarget, 0, len(to))}
	for _, t := range to {
		ids := make([]uint32, len(t.SubIDs))
		for i, id := range t.SubIDs {
			ids[i] = uint32(id)
		}
		fm.Sessions = append(fm.Sessions, &edgev1.SessionTarget{Session: &commonv1.SessionKey{Tenant: t.Tenant, ClientId: t.ClientID},
			Epoch: t.Epoch, Qos: uint32(t.QoS), SubscriptionIdentifiers: ids, Retain: t.Retain})
	}
	sent := &pending{msg: fm, waits: true}
	l.send(sent)
	return func() error { return waitOne(ctx, deadline, bound, sent) }, nil
}

// unknownGroup returns the first of owed that routes name no edge for.
func unknownGroup(owed []broker.GroupKey, routes []GroupRoute) (broker.GroupKey, bool) {
	for _, k := range owed {
		if !slices.ContainsFunc(routes, func(g GroupRoute) bool {
			return g.Name == k.Name && g.Filter == k.Filter && len(g.Edges) > 0
		}) {
			return k, true
		}
	}
	return broker.GroupKey{}, false
}

// dest is one peer a message goes to, with the shared groups it serves.
type dest struct {
	peer   Peer
	shared []*edgev1.SharedTarget
	// owes are the groups the peer serves by its own members when no edge
	// was chosen per group (unsettled routes).
	owes []broker.GroupKey
}

// owedBy notes, on the dests of routes that name no edge per group, the
// groups each serves by its own members as far as the routes tell: a
// group of an edge that left before taking the message is owed a member
// again unless another edge that had members took it. A group with
// members here is served here.
func owedBy(dests []dest, groups []GroupRoute, self string) {
	for _, g := range groups {
		if slices.ContainsFunc(g.Edges, func(p Peer) bool { return p.ID == self }) {
			continue
		}
		k := broker.GroupKey{Name: g.Name, Filter: g.Filter}
		for _, p := range g.Edges {
			for i := range dests {
				if dests[i].peer.ID == p.ID {
					dests[i].owes = append(dests[i].owes, k)
				}
			}
		}
	}
}

// destFor returns dests with p in it, and p's index.
func destFor(dests []dest, p Peer) ([]dest, int) {
	for i := range dests {
		if dests[i].peer.ID == p.ID {
			return dests, i
		}
	}
	return append(dests, dest{peer: p}), len(dests)
}

// pick chooses the edge that serves a shared group for one message: the
// group's edges in turn (sorted, so every publisher edge cycles the same
// way).
func (f *Forwarder) pick(tenant string, g GroupRoute) Peer {
	if len(g.Edges) == 1 {
		return g.Edges[0]
	}
	edges := slices.SortedFunc(slices.Values(g.Edges), func(a, b Peer) int { return strings.Compare(a.ID, b.ID) })
	key := tenant + "\x00" + g.Name + "\x00" + g.Filter
	c, _ := f.turns.LoadOrStore(key, new(atomic.Uint64))
	return edges[c.(*atomic.Uint64).Add(1)%uint64(len(edges))]
}

// pickFor is pick for m. A QoS 2 message goes to the edge chosen for the
// group before (a DUP resend of a publish that was not acknowledged:
// broker.Message.EdgeFor), while that edge still has members: that edge's
// member may have it already, and another edge would give it to a second
// member of the group ([MQTT-4.8.2-5]). The choice is recorded on m, for
// the broker to remember if the publish is not acknowledged.
func (f *Forwarder) pickFor(m *broker.Message, tenant string, g GroupRoute) Peer {
	if m.QoS != 2 {
		return f.pick(tenant, g)
	}
	key := broker.GroupKey{Name: g.Name, Filter: g.Filter}
	if id := m.EdgeFor(key); id != "" {
		if i := slices.IndexFunc(g.Edges, func(p Peer) bool { return p.ID == id }); i >= 0 {
			return g.Edges[i]
		}
	}
	p := f.pick(tenant, g)
	m.ChoseEdge(key, p.ID)
	return p
}

// hold asks the peer to report what becomes of a QoS 1 message's group
// deliveries, which this edge keeps until then; nil when none is kept.
func (f *Forwarder) hold(m *broker.Message, fm *edgev1.ForwardMessage) []heldKey {
	if m.QoS != 1 || f.Redispatch == nil || len(fm.GetShared()) == 0 {
		return nil
	}
	return hold(fm)
}

// defaultMaxHeldPerPeer is the default of Forwarder.MaxHeldPerPeer.
const defaultMaxHeldPerPeer = 1 << 17

func (f *Forwarder) bound() time.Duration {
	if f.Bound <= 0 {
		return 30 * time.Second
	}
	return f.Bound
}

func (f *Forwarder) log() *slog.Logger {
	if f.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return f.Logger
}

var _ broker.Peers = (*Forwarder)(nil)

// plainScratch holds the buffers QoS 0 messages are encoded in before the
// links copy them (sendPlain).
var plainScratch = sync.Pool{New: func() any { return new([]byte) }}

// putPlainScratch gives scratch back, as *raw grew it, unless it grew past
// what a pooled buffer may keep (a large payload).
func putPlainScratch(scratch *[]byte, raw *[]byte) {
	if cap(*raw) > 64<<10 {
		return
	}
	if *raw != nil {
		*scratch = (*raw)[:0]
	}
	plainScratch.Put(scratch)
}
