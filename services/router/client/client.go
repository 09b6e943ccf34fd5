// Package client is the edge side of the router: it keeps the edge's
// aggregated route set in sync with the router over one RouteSync stream and
// answers "which edges must receive (tenant, topic)?" from a replicated trie
// of wildcard-first filters, a bounded cache of anchor answers, per-tenant
// anchor Bloom filters, and, when none of those is valid, a Lookup RPC.
//
// Every answer held locally is trusted only while the stream heartbeats: a
// cache entry is valid until min(fetch start + lease, last heartbeat +
// lease). When nothing valid is held, [Client.Route] asks the router and
// retries until it gets an answer or its context ends: a message is never
// dropped for lack of a route answer.
package client

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/topic"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
	"github.com/keelmq/keel/services/router/routes"
)

// ErrRejected reports a route the router refused (e.g. the wildcard cap).
var ErrRejected = errors.New("router client: route rejected")

// ErrClosed reports a call after Run returned.
var ErrClosed = errors.New("router client: closed")

// Defaults.
const (
	DefaultCacheSize = 100_000
	DefaultLease     = 2 * time.Second
)

// Config configures a Client.
type Config struct {
	// URL is the router node's API base URL; Lookups go to the same node as
	// the stream, which records the edge as a cacher there.
	URL         string
	EdgeID      string
	Incarnation uint64
	// HTTPClient must speak HTTP/2 (h2c for plain http URLs).
	HTTPClient *http.Client
	CacheSize  int
	Logger     *slog.Logger
}

// Result is where a message must go.
type Result struct {
	// Edges hold a non-shared matching route.
	Edges []string
	// Groups are the matching shared groups with their member edges.
	Groups []Group
	// Looked is true when the answer needed a Lookup RPC.
	Looked bool
}

// Group is a shared group route.
type Group struct {
	Name, Filter string
	Edges        []string
}

type cacheEntry struct {
	until  time.Time
	routes []*routerv1.AnchorRoute // empty: negative entry
}

type wildVal struct {
	edge, group, filter string
}

type pending struct {
	delta *routerv1.RouteDelta
	done  chan error
}

// Client is one edge's routing client.
type Client struct {
	cfg    Config
	api    routerv1connect.RouterServiceClient
	logger *slog.Logger

	mu       sync.Mutex
	local    map[routes.Key]int // local subscriber counts; guarded by mu
	seq      uint64             // last delta seq assigned; guarded by mu
	acked    uint64             // guarded by mu
	unacked  []*pending         // in seq order; guarded by mu
	stream   *connect.BidiStreamForClient[routerv1.RouteSyncRequest, routerv1.RouteSyncResponse]
	sendMu   sync.Mutex // serialises stream sends
	ready    bool
	lastHB   time.Time
	lease    time.Duration
	gen      uint64 // bumped on every invalidation; guarded by mu
	cache    map[[2]string]*cacheEntry
	wild     map[string]*topic.Trie[wildVal] // by tenant
	wildInc  map[[4]string]uint64            // (tenant, filter, group, edge) → incarnation
	blooms   map[string]*routes.Bloom        // by tenant
	bloomBuf map[string]*routerv1.BloomChunk // assembling: tenant → header with all bits so far
	stats    Stats
}

// Stats counts how answers were found.
type Stats struct {
	Routes, Lookups, CacheHits, BloomNegatives uint64
}

// New builds a client; Run connects it.
func New(cfg Config) (*Client, error) {
	if cfg.URL == "" || cfg.EdgeID == "" || cfg.Incarnation == 0 {
		return nil, errors.New("router client: URL, EdgeID and Incarnation are required")
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = http.DefaultClient
	}
	if cfg.CacheSize <= 0 {
		cfg.CacheSize = DefaultCacheSize
	}
	if cfg.Logger == nil {
		cfg.Logger = logging.Discard()
	}
	return &Client{cfg: cfg, logger: cfg.Logger,
		api:   routerv1connect.NewRouterServiceClient(cfg.HTTPClient, cfg.URL, connect.WithGRPC()),
		local: map[routes.Key]int{}, lease: DefaultLease, cache: map[[2]string]*cacheEntry{},
		wild: map[string]*topic.Trie[wildVal]{}, wildInc: map[[4]string]uint64{}, blooms: map[string]*routes.Bloom{},
		bloomBuf: map[string]*routerv1.BloomChunk{}}, nil
}

// Stats returns counters.
func (c *Client) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stats
}

// Ready reports whether the client holds the full wildcard table and Bloom
// filters under a live lease.
func (c *Client) Ready() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.validLocked(time.Now())
}

func (c *Client) validLocked(now time.Time) bool {
	return c.ready && now.Before(c.lastHB.Add(c.lease))
}

func parseFilter(tenant, filter string) (routes.Key, error) {
	group, inner, ok, err := topic.ParseShare(filter)
	if err != nil {
		return routes.Key{}, err
	}
	if !ok {
		inner = filter
	}
	k := routes.Key{Tenant: tenant, Filter: inner, Group: group}
	return k, routes.Validate(k, routes.DefaultLimits)
}

// Subscribe registers one local subscriber of filter (which may carry a
// share prefix) and returns once the route is durable at the router and every
// contrary cache is gone: the caller may send SUBACK then.
func (c *Client) Subscribe(ctx context.Context, tenant, filter string) error {
	return c.change(ctx, tenant, filter, +1)
}

// Unsubscribe drops one local subscriber; the route goes when the last does.
func (c *Client) Unsubscribe(ctx context.Context, tenant, filter string) error {
	return c.change(ctx, tenant, filter, -1)
}

func (c *Client) change(ctx context.Context, tenant, filter string, by int) error {
	k, err := parseFilter(tenant, filter)
	if err != nil {
		return err
	}
	c.mu.Lock()
	n := c.local[k] + by
	var op routerv1.RouteOp
	switch {
	case by > 0 && n == 1:
		op = routerv1.RouteOp_ROUTE_OP_ADD
	case by < 0 && n == 0:
		op = routerv1.RouteOp_ROUTE_OP_REMOVE
	}
	if n <= 0 {
		delete(c.local, k)
	} else {
		c.local[k] = n
	}
	if op == routerv1.RouteOp_ROUTE_OP_UNSPECIFIED {
		c.mu.Unlock()
		return nil
	}
	c.seq++
	p := &pending{delta: &routerv1.RouteDelta{Seq: c.seq, Op: op, Count: 1,
		Route: &routerv1.Route{Tenant: k.Tenant, Filter: k.Filter, ShareGroup: k.Group}}, done: make(chan error, 1)}
	c.unacked = append(c.unacked, p)
	st := c.stream
	c.mu.Unlock()
	if st != nil {
		// A failed send is retried by the next stream from unacked.
		_ = c.send(st, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Deltas{Deltas: &routerv1.RouteDeltas{Deltas: []*routerv1.RouteDelta{p.delta}}}})
	}
	select {
	case err := <-p.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (c *Client) send(st *connect.BidiStreamForClient[routerv1.RouteSyncRequest, routerv1.RouteSyncResponse], req *routerv1.RouteSyncRequest) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	return st.Send(req)
}

// Run keeps a stream to the router until ctx ends, reconnecting with backoff.
func (c *Client) Run(ctx context.Context) error {
	backoff := 50 * time.Millisecond
	for ctx.Err() == nil {
		start := time.Now()
		err := c.runStream(ctx)
		if ctx.Err() != nil {
			break
		}
		c.logger.Debug("route stream ended", logging.Err(err))
		if time.Since(start) > 5*time.Second {
			backoff = 50 * time.Millisecond
		}
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
		}
		backoff = min(2*backoff, 2*time.Second)
	}
	c.mu.Lock()
	for _, p := range c.unacked {
		p.done <- ErrClosed
	}
	c.unacked = nil
	c.mu.Unlock()
	return nil
}

func (c *Client) runStream(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st := c.api.RouteSync(ctx)
	c.mu.Lock()
	hello := &routerv1.RouteSyncHello{EdgeId: c.cfg.EdgeID, Incarnation: c.cfg.Incarnation, AckedSeq: c.acked}
	var resend []*routerv1.RouteDelta
	for _, p := range c.unacked {
		resend = append(resend, p.delta)
	}
	dig, seq := c.digestLocked()
	c.ready = false
	c.stream = st
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		if c.stream == st {
			c.stream = nil
		}
		c.mu.Unlock()
	}()
	if err := c.send(st, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Hello{Hello: hello}}); err != nil {
		return err
	}
	if len(resend) > 0 {
		if err := c.send(st, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Deltas{Deltas: &routerv1.RouteDeltas{Deltas: resend}}}); err != nil {
			return err
		}
	}
	if err := c.send(st, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Digest{Digest: &routerv1.RouteSetDigest{Seq: seq, RouteCount: dig.Count, Digest: dig.Sum}}}); err != nil {
		return err
	}
	for {
		resp, err := st.Receive()
		if err != nil {
			return err
		}
		if err := c.handle(st, resp); err != nil {
			return err
		}
	}
}

// digestLocked returns the digest of the routes the router should hold: the
// local set as of the last delta assigned.
//
// c.mu must be held.
func (c *Client) digestLocked() (routes.Digest, uint64) {
	var d routes.Digest
	for k := range c.local {
		d.Add(k)
	}
	return d, c.seq
}

func (c *Client) snapshot(st *connect.BidiStreamForClient[routerv1.RouteSyncRequest, routerv1.RouteSyncResponse]) error {
	c.mu.Lock()
	rs := make([]*routerv1.Route, 0, len(c.local))
	for k := range c.local {
		rs = append(rs, &routerv1.Route{Tenant: k.Tenant, Filter: k.Filter, ShareGroup: k.Group})
	}
	seq := c.seq
	c.mu.Unlock()
	const chunk = 4096
	for i := 0; ; i += chunk {
		end := min(i+chunk, len(rs))
		if err := c.send(st, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Snapshot{Snapshot: &routerv1.RouteSetSnapshot{
			Seq: seq, Routes: rs[i:end], Last: end == len(rs)}}}); err != nil {
			return err
		}
		if end == len(rs) {
			return nil
		}
	}
}

func (c *Client) handle(st *connect.BidiStreamForClient[routerv1.RouteSyncRequest, routerv1.RouteSyncResponse], resp *routerv1.RouteSyncResponse) error {
	now := time.Now()
	ack := true
	switch m := resp.GetMsg().(type) {
	case *routerv1.RouteSyncResponse_Heartbeat:
		c.mu.Lock()
		c.lastHB = now
		if l := m.Heartbeat.GetCacheLease().AsDuration(); l > 0 {
			c.lease = l
		}
		c.mu.Unlock()
		ack = false
	case *routerv1.RouteSyncResponse_Ack:
		rej := map[uint64]string{}
		for _, r := range m.Ack.GetRejected() {
			rej[r.GetSeq()] = r.GetReason()
		}
		c.mu.Lock()
		seq := m.Ack.GetSeq()
		c.acked = max(c.acked, seq)
		i := 0
		for ; i < len(c.unacked) && c.unacked[i].delta.GetSeq() <= seq; i++ {
			p := c.unacked[i]
			if r, ok := rej[p.delta.GetSeq()]; ok {
				k := routes.Key{Tenant: p.delta.GetRoute().GetTenant(), Filter: p.delta.GetRoute().GetFilter(), Group: p.delta.GetRoute().GetShareGroup()}
				if p.delta.GetOp() == routerv1.RouteOp_ROUTE_OP_ADD {
					delete(c.local, k)
				}
				p.done <- fmt.Errorf("%w: %s", ErrRejected, r)
			} else {
				p.done <- nil
			}
		}
		c.unacked = c.unacked[i:]
		c.mu.Unlock()
		ack = false
	case *routerv1.RouteSyncResponse_DigestResult:
		ack = false
		if !m.DigestResult.GetMatch() {
			return c.snapshot(st)
		}
	case *routerv1.RouteSyncResponse_Resync:
		ack = false
		return c.snapshot(st)
	case *routerv1.RouteSyncResponse_Ready:
		c.mu.Lock()
		c.ready = true
		c.lastHB = now
		c.mu.Unlock()
	case *routerv1.RouteSyncResponse_Invalidation:
		c.invalidate(m.Invalidation)
	case *routerv1.RouteSyncResponse_Wildcard:
		c.applyWildcard(m.Wildcard)
	case *routerv1.RouteSyncResponse_Bloom:
		c.applyBloom(m.Bloom)
	}
	if !ack {
		return nil
	}
	return c.send(st, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Ack{Ack: &routerv1.RouteSyncAck{RouterSeq: resp.GetSeq()}}})
}

func (c *Client) invalidate(inv *routerv1.RouteInvalidation) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.gen++
	t := inv.GetTenant()
	for _, a := range inv.GetAnchors() {
		delete(c.cache, [2]string{t, a})
	}
	for _, a := range inv.GetNewAnchors() {
		delete(c.cache, [2]string{t, a})
		if b := c.blooms[t]; b != nil {
			b.Add(a)
		}
	}
	if len(inv.GetDeadEdges()) > 0 {
		clear(c.cache)
		for _, de := range inv.GetDeadEdges() {
			for k, inc := range c.wildInc {
				if k[3] == de.GetEdgeId() && inc <= de.GetIncarnation() {
					c.wild[k[0]].Remove(k[1], wildVal{edge: k[3], group: k[2], filter: k[1]})
					delete(c.wildInc, k)
				}
			}
		}
	}
}

func (c *Client) applyWildcard(w *routerv1.WildcardDeltas) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if w.GetReset_() {
		c.wild = map[string]*topic.Trie[wildVal]{}
		c.wildInc = map[[4]string]uint64{}
	}
	for _, d := range w.GetDeltas() {
		r := d.GetRoute()
		t := c.wild[r.GetTenant()]
		if t == nil {
			t = &topic.Trie[wildVal]{}
			c.wild[r.GetTenant()] = t
		}
		k := [4]string{r.GetTenant(), r.GetFilter(), r.GetShareGroup(), d.GetEdgeId()}
		v := wildVal{edge: d.GetEdgeId(), group: r.GetShareGroup(), filter: r.GetFilter()}
		if d.GetOp() == routerv1.RouteOp_ROUTE_OP_ADD {
			t.Add(r.GetFilter(), v)
			c.wildInc[k] = d.GetIncarnation()
		} else if inc, ok := c.wildInc[k]; ok && inc <= d.GetIncarnation() {
			t.Remove(r.GetFilter(), v)
			delete(c.wildInc, k)
		}
	}
}

func (c *Client) applyBloom(b *routerv1.BloomChunk) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := b.GetTenant()
	cur := c.bloomBuf[t]
	if cur == nil || cur.GetVersion() != b.GetVersion() || b.GetOffset() == 0 {
		if b.GetBitCount()/8 > 1<<30 {
			return
		}
		cur = &routerv1.BloomChunk{Tenant: t, Version: b.GetVersion(), BitCount: b.GetBitCount(), HashCount: b.GetHashCount(),
			Bits: make([]byte, b.GetBitCount()/8)}
		c.bloomBuf[t] = cur
	}
	if b.GetOffset()+uint64(len(b.GetBits())) <= uint64(len(cur.Bits)) {
		copy(cur.Bits[b.GetOffset():], b.GetBits())
	}
	if b.GetLast() {
		delete(c.bloomBuf, t)
		if bl, err := routes.BloomFromBits(cur.Bits, cur.GetBitCount(), cur.GetHashCount()); err == nil {
			c.blooms[t] = bl
		}
	}
}

// Route returns the edges and shared groups that must receive a message
// published on (tenant, name). It retries the router until it answers or ctx
// ends.
func (c *Client) Route(ctx context.Context, tenant, name string) (Result, error) {
	if err := routes.ValidateTopic(tenant, name, routes.DefaultLimits); err != nil {
		return Result{}, err
	}
	now := time.Now()
	edges := map[string]bool{}
	groups := map[[2]string]map[string]bool{}
	c.mu.Lock()
	c.stats.Routes++
	valid := c.validLocked(now)
	need := !valid
	if valid {
		if t := c.wild[tenant]; t != nil {
			t.Match(name, func(v wildVal) bool {
				addTo(edges, groups, v.edge, v.group, v.filter)
				return true
			})
		}
		bl := c.blooms[tenant]
		routes.ProbeAnchors(name, func(a string) bool {
			if e := c.cache[[2]string{tenant, a}]; e != nil && now.Before(e.until) {
				c.stats.CacheHits++
				for _, r := range e.routes {
					if topic.Match(r.GetFilter(), name) {
						for _, id := range r.GetEdgeIds() {
							addTo(edges, groups, id, r.GetShareGroup(), r.GetFilter())
						}
					}
				}
				return true
			}
			if bl != nil && !bl.MayContain(a) {
				c.stats.BloomNegatives++
				return true
			}
			need = true
			return false
		})
	}
	gen := c.gen
	c.mu.Unlock()
	if !need {
		return toResult(edges, groups, false), nil
	}
	backoff := 10 * time.Millisecond
	for {
		start := time.Now()
		resp, err := c.api.Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: tenant, Topic: name, EdgeId: c.cfg.EdgeID, Incarnation: c.cfg.Incarnation}))
		if err == nil {
			c.mu.Lock()
			c.stats.Lookups++
			// Cache only if no invalidation arrived meanwhile: the answer may
			// predate it.
			if c.gen == gen {
				until := start.Add(min(resp.Msg.GetCacheLease().AsDuration(), c.lease))
				for _, ar := range resp.Msg.GetAnchors() {
					if len(c.cache) >= c.cfg.CacheSize {
						for k := range c.cache { // evict an arbitrary entry
							delete(c.cache, k)
							break
						}
					}
					c.cache[[2]string{tenant, strings.Clone(ar.GetAnchor())}] = &cacheEntry{until: until, routes: ar.GetRoutes()}
				}
			}
			c.mu.Unlock()
			res := Result{Edges: resp.Msg.GetEdgeIds(), Looked: true}
			for _, g := range resp.Msg.GetSharedGroups() {
				res.Groups = append(res.Groups, Group{Name: g.GetGroup(), Filter: g.GetFilter(), Edges: g.GetEdgeIds()})
			}
			return res, nil
		}
		if connect.CodeOf(err) == connect.CodeInvalidArgument {
			return Result{}, err
		}
		select {
		case <-ctx.Done():
			return Result{}, fmt.Errorf("route %s: %w (last error: %w)", name, ctx.Err(), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}

func addTo(edges map[string]bool, groups map[[2]string]map[string]bool, edge, group, filter string) {
	if group == "" {
		edges[edge] = true
		return
	}
	g := groups[[2]string{group, filter}]
	if g == nil {
		g = map[string]bool{}
		groups[[2]string{group, filter}] = g
	}
	g[edge] = true
}

func toResult(edges map[string]bool, groups map[[2]string]map[string]bool, looked bool) Result {
	r := Result{Looked: looked}
	for e := range edges {
		r.Edges = append(r.Edges, e)
	}
	slices.Sort(r.Edges)
	for g, es := range groups {
		gr := Group{Name: g[0], Filter: g[1]}
		for e := range es {
			gr.Edges = append(gr.Edges, e)
		}
		slices.Sort(gr.Edges)
		r.Groups = append(r.Groups, gr)
	}
	return r
}
