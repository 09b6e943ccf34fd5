// Package routerclient is the edge side of the router: it keeps the edge's
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
package routerclient

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/routes"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/topic"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
)

// ErrRejected reports a route the router refused (e.g. the wildcard cap).
var ErrRejected = errors.New("router client: route rejected")

// ErrClosed reports a call after Run returned.
var ErrClosed = errors.New("router client: closed")

// Defaults.
const (
	DefaultCacheSize = 100_000
	DefaultLease     = 2 * time.Second
	// DefaultLookupTimeout: see Config.LookupTimeout.
	DefaultLookupTimeout = 10 * time.Second
)

// Config configures a Client.
type Config struct {
	// URL is the router node's API base URL; Lookups go to the same node as
	// the stream, which records the edge as a cacher there.
	URL string
	// FallbackURLs are other router nodes; after a stream fails the client
	// moves to the next URL in [URL, FallbackURLs...] (a Kubernetes Service URL
	// in URL alone does the same through the load balancer).
	FallbackURLs []string
	EdgeID       string
	Incarnation  uint64
	// HTTPClient must speak HTTP/2 (h2c for plain http URLs).
	HTTPClient *http.Client
	CacheSize  int
	// LookupTimeout bounds the Lookup retries of a Route call whose context
	// has no deadline of its own (default DefaultLookupTimeout). A cached
	// answer needs no deadline, so callers on the hot path need not make
	// one per message.
	LookupTimeout time.Duration
	Logger        *slog.Logger
	// Registerer, when set, receives the client's metrics
	// (keel_edge_route_*).
	Registerer prometheus.Registerer
}

// Result is where a message must go.
type Result struct {
	// Edges hold a non-shared matching route.
	Edges []string
	// Groups are the matching shared groups with their member edges.
	Groups []Group
	// Looked is true when the answer needed a Lookup RPC.
	Looked bool
	// All: the router is settling a membership change and its answers may
	// miss a route, so the message must go to every edge (each delivers to
	// its own matching subscribers). Edges and Groups hold what it knows.
	All bool
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

// pending is a delta the router has not acked yet. Every subscriber the
// delta stands for waits on it: done closes, with err set, when the router
// acks or refuses it or the client stops.
type pending struct {
	delta *routerv1.RouteDelta
	done  chan struct{}
	err   error
}

func (p *pending) finish(err error) {
	p.err = err
	close(p.done)
}

func (p *pending) wait(ctx context.Context) error {
	select {
	case <-p.done:
		return p.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

type syncStream = connect.BidiStreamForClient[routerv1.RouteSyncRequest, routerv1.RouteSyncResponse]

// Client is one edge's routing client.
//
// Lock order: sendMu before mu. mu is never held while sending on the
// stream, so a stream blocked by flow control never stalls Route.
type Client struct {
	cfg Config
	// clockOrigin is the origin of the edge clock sent in acks.
	clockOrigin time.Time
	// inc is the edge's current incarnation: cfg.Incarnation until the edge
	// rejoins the cluster under a newer one (SetIncarnation).
	inc    atomic.Uint64
	apis   []routerv1connect.RouterServiceClient // one per URL
	logger *slog.Logger
	m      *metrics

	// sendMu serialises stream sends and makes "assign seqs, then send" one
	// step as seen by the router: deltas leave in seq order, and no delta is
	// sent between the hello and the resend of a new stream, nor inside a
	// snapshot. The router skips any delta at or below the last seq it
	// applied, so a delta overtaken by a later one would be lost.
	sendMu sync.Mutex

	mu      sync.Mutex
	cur     int                // index of the URL of the current stream; guarded by mu
	local   map[routes.Key]int // local subscriber counts; guarded by mu
	seq     uint64             // last delta seq assigned; guarded by mu
	sent    uint64             // last delta seq sent on stream; guarded by mu
	acked   uint64             // guarded by mu
	unacked []*pending         // in seq order; guarded by mu
	// adds holds, by key, the unacked ADD the key's local subscribers wait
	// on: a subscriber joining a filter whose ADD is still on its way is
	// not routed before it is; guarded by mu.
	adds   map[routes.Key]*pending
	closed bool        // Run returned; guarded by mu
	stream *syncStream // guarded by mu
	// endStream cancels the current stream's context; guarded by mu.
	endStream context.CancelFunc
	ready     bool
	lastHB    time.Time
	lease     time.Duration
	// unsettled: the router said its answers may miss routes (RouteSettle).
	unsettled bool
	// echoed: the stream's heartbeats echo the edge clock; the lease then
	// runs from the echo only.
	echoed   bool
	gen      uint64 // bumped on every invalidation; guarded by mu
	cache    map[[2]string]*cacheEntry
	wild     map[string]*topic.Trie[wildVal] // by tenant
	wildInc  map[[4]string]uint64            // (tenant, filter, group, edge) → incarnation
	blooms   map[string]*routes.Bloom        // by tenant
	bloomBuf map[string]*bloomAsm            // assembling, by tenant
	stats    Stats
}

// Stats counts how answers were found.
type Stats struct {
	// Routes is the number of Route calls; Local of them were answered
	// without an RPC (the edge-side hit ratio is Local/Routes).
	Routes, Local uint64
	// Lookups and LookupErrors count Lookup RPCs.
	Lookups, LookupErrors uint64
	// CacheHits, BloomNegatives and Misses count anchor probes answered by
	// the cache, by the Bloom filter, and by neither (which needs a Lookup).
	CacheHits, BloomNegatives, Misses uint64
	// Unsettled counts answers with Result.All set.
	Unsettled uint64
}

// New builds a client; Run connects it.
func New(cfg Config) (*Client, error) {
	if cfg.URL == "" || cfg.EdgeID == "" || cfg.Incarnation == 0 {
		return nil, errors.New("router client: URL, EdgeID and Incarnation are required")
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = http.DefaultClient
	}
	if cfg.LookupTimeout <= 0 {
		cfg.LookupTimeout = DefaultLookupTimeout
	}
	if cfg.CacheSize <= 0 {
		cfg.CacheSize = DefaultCacheSize
	}
	if cfg.Logger == nil {
		cfg.Logger = logging.Discard()
	}
	c := &Client{cfg: cfg, logger: cfg.Logger, clockOrigin: time.Now(),
		local: map[routes.Key]int{}, adds: map[routes.Key]*pending{}, lease: DefaultLease, cache: map[[2]string]*cacheEntry{},
		wild: map[string]*topic.Trie[wildVal]{}, wildInc: map[[4]string]uint64{}, blooms: map[string]*routes.Bloom{},
		bloomBuf: map[string]*bloomAsm{}}
	c.inc.Store(cfg.Incarnation)
	for _, u := range append([]string{cfg.URL}, cfg.FallbackURLs...) {
		c.apis = append(c.apis, routerv1connect.NewRouterServiceClient(cfg.HTTPClient, u, rpc.ClientOptions(connect.WithGRPC())...))
	}
	m, err := newMetrics(cfg.Registerer, c)
	if err != nil {
		return nil, err
	}
	c.m = m
	return c, nil
}

// api returns the client of the router node the current stream goes to.
func (c *Client) api() routerv1connect.RouterServiceClient {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.apis[c.cur]
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
//
// An error wrapping ErrRejected (the router refused the route, or the
// filter is invalid) counts no subscriber. Any other (the caller's context
// ended first) leaves the subscriber counted and its route on its way: the
// caller unsubscribes it. Only the caller knows whether it still holds the
// subscription (its session may have ended meanwhile and unsubscribed
// it), so the client does not take the count back itself.
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
		return fmt.Errorf("%w: %w", ErrRejected, err)
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return ErrClosed
	}
	n := c.local[k] + by
	if n <= 0 {
		delete(c.local, k)
	} else {
		c.local[k] = n
	}
	var p *pending
	switch {
	case by > 0 && n == 1:
		p = c.queueLocked(k, routerv1.RouteOp_ROUTE_OP_ADD)
	case by < 0 && n == 0:
		p = c.queueLocked(k, routerv1.RouteOp_ROUTE_OP_REMOVE)
	case by > 0:
		// Not the filter's first subscriber, but its route may not be at
		// the router yet: this subscriber is routed when the ADD is acked
		// (a SUBACK sent before then would promise messages published
		// meanwhile, which reach no edge).
		if add := c.adds[k]; add != nil {
			c.mu.Unlock()
			return add.wait(ctx)
		}
	}
	c.mu.Unlock()
	if p == nil {
		return nil
	}
	if st := c.streamNow(); st != nil {
		// A failed send is retried by the next stream from unacked.
		_ = c.flush(st)
	}
	return p.wait(ctx)
}

// queueLocked assigns the next seq to a delta of k and queues it for the
// stream.
//
// c.mu must be held.
func (c *Client) queueLocked(k routes.Key, op routerv1.RouteOp) *pending {
	c.seq++
	p := &pending{delta: &routerv1.RouteDelta{Seq: c.seq, Op: op, Count: 1,
		Route: &routerv1.Route{Tenant: k.Tenant, Filter: k.Filter, ShareGroup: k.Group}}, done: make(chan struct{})}
	c.unacked = append(c.unacked, p)
	if op == routerv1.RouteOp_ROUTE_OP_ADD {
		c.adds[k] = p
	} else {
		delete(c.adds, k)
	}
	return p
}

func (c *Client) streamNow() *syncStream {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stream
}

// flush sends, in seq order and as one batch, every unacked delta not yet
// sent on st. Deltas of concurrent subscribers coalesce here: whoever holds
// sendMu sends what the others queued meanwhile.
func (c *Client) flush(st *syncStream) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	c.mu.Lock()
	if c.stream != st {
		c.mu.Unlock()
		return nil
	}
	i := len(c.unacked)
	for i > 0 && c.unacked[i-1].delta.GetSeq() > c.sent {
		i--
	}
	ds := make([]*routerv1.RouteDelta, 0, len(c.unacked)-i)
	for _, p := range c.unacked[i:] {
		ds = append(ds, p.delta)
	}
	if len(ds) > 0 {
		c.sent = ds[len(ds)-1].GetSeq()
	}
	c.mu.Unlock()
	if len(ds) == 0 {
		return nil
	}
	return st.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Deltas{Deltas: &routerv1.RouteDeltas{Deltas: ds}}})
}

func (c *Client) send(st *syncStream, req *routerv1.RouteSyncRequest) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	return st.Send(req)
}

// SetIncarnation moves the client to the edge's new incarnation after the
// edge rejoined the cluster: the route stream is opened again under it, so
// the router takes the edge's whole route set anew, while routes of the
// old incarnation are removed as a dead edge's. (A router refuses a
// stream from an incarnation it has declared dead, so without this the
// rejoined edge would register no route again.)
func (c *Client) SetIncarnation(inc uint64) {
	for {
		cur := c.inc.Load()
		if inc <= cur {
			return
		}
		if c.inc.CompareAndSwap(cur, inc) {
			break
		}
	}
	c.mu.Lock()
	end := c.endStream
	c.mu.Unlock()
	if end != nil {
		end()
	}
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
		c.m.streamErrors.Inc()
		c.mu.Lock()
		c.cur = (c.cur + 1) % len(c.apis)
		c.mu.Unlock()
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
		p.finish(ErrClosed)
	}
	c.unacked = nil
	clear(c.adds)
	c.closed = true
	c.mu.Unlock()
	return nil
}

func (c *Client) runStream(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	c.mu.Lock()
	c.endStream = cancel
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.stream = nil
		c.ready = false
		c.mu.Unlock()
	}()
	st, err := c.open(ctx)
	if st != nil {
		// End the stream explicitly: cancelling its context alone can leave
		// the router's handler (and its server's shutdown) waiting on a
		// stream this side abandoned.
		defer func() {
			_ = st.CloseRequest()
			_ = st.CloseResponse()
		}()
	}
	if err != nil {
		return err
	}
	var processed atomic.Uint64 // highest router seq handled on this stream
	go c.clockAcks(ctx, st, &processed)
	for {
		resp, err := st.Receive()
		if err != nil {
			return err
		}
		if err := c.handle(st, resp); err != nil {
			return err
		}
		processed.Store(resp.GetSeq())
	}
}

// clockAckInterval is how often an ack carries the edge clock when no
// message needs acking: the cache lease runs from the reading the router
// echoes, so the interval (plus a round trip) is what the lease loses.
const clockAckInterval = 100 * time.Millisecond

// clockAcks acknowledges what the stream handled, with the edge clock, on a
// timer until ctx ends.
func (c *Client) clockAcks(ctx context.Context, st *syncStream, processed *atomic.Uint64) {
	t := time.NewTicker(clockAckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if c.send(st, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Ack{Ack: &routerv1.RouteSyncAck{
			RouterSeq: processed.Load(), EdgeClock: c.clock()}}}) != nil {
			return
		}
	}
}

// clock reads the edge's monotonic clock for RouteSyncAck.edge_clock
// (always > 0: 0 means none).
func (c *Client) clock() int64 { return int64(time.Since(c.clockOrigin)) + 1 }

// open starts a stream and sends the hello, every unacked delta and the
// digest, holding sendMu so no other delta goes out in between. The stream
// comes back with an error too, for the caller to close.
func (c *Client) open(ctx context.Context) (*syncStream, error) {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	c.mu.Lock()
	st := c.apis[c.cur].RouteSync(ctx)
	hello := &routerv1.RouteSyncHello{EdgeId: c.cfg.EdgeID, Incarnation: c.inc.Load(), AckedSeq: c.acked}
	var resend []*routerv1.RouteDelta
	for _, p := range c.unacked {
		resend = append(resend, p.delta)
	}
	dig, seq := c.digestLocked()
	c.ready = false
	// A node that is settling says so before its ready.
	c.unsettled = false
	c.echoed = false
	c.stream = st
	c.sent = seq
	// Cache entries are invalidated only by the router node that served
	// their Lookup, which may not be the one this stream goes to: drop them
	// all, and keep in-flight Lookups from caching their answers.
	clear(c.cache)
	c.gen++
	c.mu.Unlock()
	if err := st.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Hello{Hello: hello}}); err != nil {
		return st, err
	}
	if len(resend) > 0 {
		if err := st.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Deltas{Deltas: &routerv1.RouteDeltas{Deltas: resend}}}); err != nil {
			return st, err
		}
	}
	if err := st.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Digest{Digest: &routerv1.RouteSetDigest{Seq: seq, RouteCount: dig.Count, Digest: dig.Sum}}}); err != nil {
		return st, err
	}
	return st, nil
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

// snapshot sends the full local route set as of the last assigned seq. It
// holds sendMu throughout: a delta sent between two chunks would be applied
// before the snapshot and then undone by it (the router drops what the
// snapshot lacks). Unsent deltas up to that seq are covered by the snapshot.
func (c *Client) snapshot(st *syncStream) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	c.mu.Lock()
	rs := make([]*routerv1.Route, 0, len(c.local))
	for k := range c.local {
		rs = append(rs, &routerv1.Route{Tenant: k.Tenant, Filter: k.Filter, ShareGroup: k.Group})
	}
	seq := c.seq
	if c.stream == st {
		c.sent = seq
	}
	c.mu.Unlock()
	c.m.snapshots.Inc()
	const chunk = 4096
	for i := 0; ; i += chunk {
		end := min(i+chunk, len(rs))
		if err := st.Send(&routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Snapshot{Snapshot: &routerv1.RouteSetSnapshot{
			Seq: seq, Routes: rs[i:end], Last: end == len(rs)}}}); err != nil {
			return err
		}
		if end == len(rs) {
			return nil
		}
	}
}

func (c *Client) handle(st *syncStream, resp *routerv1.RouteSyncResponse) error {
	now := time.Now()
	ack := true
	switch m := resp.GetMsg().(type) {
	case *routerv1.RouteSyncResponse_Heartbeat:
		c.mu.Lock()
		if echo := m.Heartbeat.GetEcho(); echo > 0 {
			// The lease runs from when the edge sent the ack echoed, so a
			// heartbeat read late (the edge stalled) cannot stretch it past
			// the router's wait for the acks queued behind it.
			if at := c.clockOrigin.Add(time.Duration(echo - 1)); at.After(c.lastHB) {
				c.lastHB = at
			}
			c.echoed = true
		} else if !c.echoed {
			c.lastHB = now // a router that does not echo
		}
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
			k := routes.Key{Tenant: p.delta.GetRoute().GetTenant(), Filter: p.delta.GetRoute().GetFilter(), Group: p.delta.GetRoute().GetShareGroup()}
			if c.adds[k] == p {
				delete(c.adds, k)
			}
			if r, ok := rej[p.delta.GetSeq()]; ok {
				if p.delta.GetOp() == routerv1.RouteOp_ROUTE_OP_ADD && c.adds[k] == nil {
					// Every subscriber counted since waits on this ADD
					// and is refused with it.
					delete(c.local, k)
				}
				p.finish(fmt.Errorf("%w: %s", ErrRejected, r))
			} else {
				p.finish(nil)
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
	case *routerv1.RouteSyncResponse_Settle:
		c.mu.Lock()
		if c.unsettled == m.Settle.GetSettled() {
			c.logger.Info("router route answers", "settled", m.Settle.GetSettled(), "reason", m.Settle.GetReason())
		}
		c.unsettled = !m.Settle.GetSettled()
		c.mu.Unlock()
	}
	if !ack {
		return nil
	}
	return c.send(st, &routerv1.RouteSyncRequest{Msg: &routerv1.RouteSyncRequest_Ack{Ack: &routerv1.RouteSyncAck{RouterSeq: resp.GetSeq(), EdgeClock: c.clock()}}})
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

// maxBloomBytes bounds one tenant's Bloom filter (2^31 bits, enough for
// tens of millions of anchors): a garbage header cannot make the edge
// allocate more.
const maxBloomBytes = 1 << 28

// bloomAsm is a Bloom filter being assembled from its chunks.
type bloomAsm struct {
	version, m uint64
	k          uint32
	bits       []byte
}

// applyBloom assembles a tenant's filter from chunks, which arrive in order
// on one stream. A filter is installed only when every byte of it arrived;
// anything inconsistent drops the assembly and keeps the previous filter.
func (c *Client) applyBloom(b *routerv1.BloomChunk) {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := b.GetTenant()
	cur := c.bloomBuf[t]
	if b.GetOffset() == 0 {
		m, k := b.GetBitCount(), b.GetHashCount()
		if m == 0 || m%8 != 0 || m/8 > maxBloomBytes || k == 0 || k > 32 {
			delete(c.bloomBuf, t)
			return
		}
		cur = &bloomAsm{version: b.GetVersion(), m: m, k: k, bits: make([]byte, 0, m/8)}
		c.bloomBuf[t] = cur
	} else if cur == nil || cur.version != b.GetVersion() || cur.m != b.GetBitCount() || cur.k != b.GetHashCount() ||
		b.GetOffset() != uint64(len(cur.bits)) {
		delete(c.bloomBuf, t)
		return
	}
	if uint64(len(b.GetBits())) > cur.m/8-uint64(len(cur.bits)) {
		delete(c.bloomBuf, t)
		return
	}
	cur.bits = append(cur.bits, b.GetBits()...)
	if !b.GetLast() {
		return
	}
	delete(c.bloomBuf, t)
	if uint64(len(cur.bits)) != cur.m/8 {
		return
	}
	if bl, err := routes.BloomFromBits(cur.bits, cur.m, cur.k); err == nil {
		c.blooms[t] = bl
	}
}

// probeLocked walks the anchors of name (tenant's) and reports whether one
// needs a Lookup: neither cached under a live lease nor ruled out by the
// tenant's Bloom filter. hit, when set, is given each cached entry found;
// st, when set, counts the probes.
func (c *Client) probeLocked(tenant, name string, now time.Time, hit func(*cacheEntry), st *Stats) (need bool) {
	bl := c.blooms[tenant]
	routes.ProbeAnchors(name, func(a string) bool {
		if e := c.cache[[2]string{tenant, a}]; e != nil && now.Before(e.until) {
			if st != nil {
				st.CacheHits++
			}
			if hit != nil {
				hit(e)
			}
			return true
		}
		if bl != nil && !bl.MayContain(a) {
			if st != nil {
				st.BloomNegatives++
			}
			return true
		}
		if st != nil {
			st.Misses++
		}
		need = true
		return false
	})
	return need
}

// Route returns the edges and shared groups that must receive a message
// published on (tenant, name). It retries the router until it answers or ctx
// ends.
func (c *Client) Route(ctx context.Context, tenant, name string) (Result, error) {
	if err := routes.ValidateTopic(tenant, name, routes.DefaultLimits); err != nil {
		return Result{}, err
	}
	res, need, gen, api := c.held(tenant, name, true)
	if !need {
		return res, nil
	}
	return c.lookup(ctx, tenant, name, gen, api)
}

// RouteAtOnce is Route without a call to the router: ok is false when the
// answer needs one (then Route makes it). A message routed this way costs
// one reading of the cache and the clock, not one to ask and one to route.
func (c *Client) RouteAtOnce(tenant, name string) (res Result, ok bool, err error) {
	if err := routes.ValidateTopic(tenant, name, routes.DefaultLimits); err != nil {
		return Result{}, false, err
	}
	res, need, _, _ := c.held(tenant, name, false)
	return res, !need, nil
}

// held answers (tenant, name) from the leading-wildcard table and the
// cache; need says a Lookup must (gen and api are for it). The stats count
// it as a route if it answers, or if lookup follows (a Route).
func (c *Client) held(tenant, name string, lookupFollows bool) (res Result, need bool, gen uint64, api routerv1connect.RouterServiceClient) {
	now := time.Now()
	var (
		edges  []string
		groups []Group
		st     Stats
	)
	c.mu.Lock()
	valid := c.validLocked(now)
	need = !valid
	if valid {
		if t := c.wild[tenant]; t != nil {
			t.Match(name, func(v wildVal) bool {
				edges, groups = addTo(edges, groups, v.edge, v.group, v.filter)
				return true
			})
		}
		need = c.probeLocked(tenant, name, now, func(e *cacheEntry) {
			for _, r := range e.routes {
				if topic.Match(r.GetFilter(), name) {
					for _, id := range r.GetEdgeIds() {
						edges, groups = addTo(edges, groups, id, r.GetShareGroup(), r.GetFilter())
					}
				}
			}
		}, &st)
	}
	if !need || lookupFollows {
		c.stats.Routes++
		c.stats.CacheHits += st.CacheHits
		c.stats.BloomNegatives += st.BloomNegatives
		c.stats.Misses += st.Misses
	}
	all := c.unsettled
	if !need {
		c.stats.Local++
		if all {
			c.stats.Unsettled++
		}
	}
	gen = c.gen
	api = c.apis[c.cur]
	c.mu.Unlock()
	if need {
		return Result{}, true, gen, api
	}
	slices.Sort(edges)
	return Result{Edges: edges, Groups: groups, All: all}, false, gen, api
}

// lookup asks the router, retrying until it answers or ctx ends, and
// caches the answer unless an invalidation came after gen.
func (c *Client) lookup(ctx context.Context, tenant, name string, gen uint64, api routerv1connect.RouterServiceClient) (Result, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.cfg.LookupTimeout)
		defer cancel()
	}
	backoff := 10 * time.Millisecond
	for {
		start := time.Now()
		resp, err := api.Lookup(ctx, connect.NewRequest(&routerv1.LookupRequest{Tenant: tenant, Topic: name, EdgeId: c.cfg.EdgeID, Incarnation: c.inc.Load()}))
		c.m.lookupSeconds.Observe(time.Since(start).Seconds())
		if err == nil {
			c.mu.Lock()
			c.stats.Lookups++
			all := resp.Msg.GetUnsettled() || c.unsettled
			if all {
				c.stats.Unsettled++
			}
			// Cache only if no invalidation arrived meanwhile (the answer may
			// predate it), the stream still heartbeats, and the answer is
			// complete.
			if c.gen == gen && c.validLocked(time.Now()) && !all {
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
			res := Result{Edges: resp.Msg.GetEdgeIds(), Looked: true, All: all}
			for _, g := range resp.Msg.GetSharedGroups() {
				res.Groups = append(res.Groups, Group{Name: g.GetGroup(), Filter: g.GetFilter(), Edges: g.GetEdgeIds()})
			}
			return res, nil
		}
		c.mu.Lock()
		c.stats.LookupErrors++
		api = c.apis[c.cur] // the stream may have moved to another node
		c.mu.Unlock()
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

// addTo adds edge to edges (group empty) or to the group's edges, keeping
// each list free of duplicates. Lists are short: linear scans beat maps and
// allocate less.
func addTo(edges []string, groups []Group, edge, group, filter string) ([]string, []Group) {
	if group == "" {
		if !slices.Contains(edges, edge) {
			edges = append(edges, edge)
		}
		return edges, groups
	}
	for i := range groups {
		if groups[i].Name == group && groups[i].Filter == filter {
			if !slices.Contains(groups[i].Edges, edge) {
				groups[i].Edges = append(groups[i].Edges, edge)
			}
			return edges, groups
		}
	}
	return edges, append(groups, Group{Name: group, Filter: filter, Edges: []string{edge}})
}
