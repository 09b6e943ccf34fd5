// Package server is a router node: the Connect API (RouteSync, Lookup,
// Status, RemoveEdge and the router-to-router ApplyRoutes and Notify), the
// single-writer apply path over the embedded Olric store, and the per-node
// replicas every edge needs in full (wildcard-first routes, anchor Bloom
// filters, dead edge incarnations).
//
// Lock order: Node.mu before edgeConn.mu; a key stripe lock (Node.keyLocks) is
// never held while taking Node.mu or waiting for an edge.
package server

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash/maphash"
	"log/slog"
	"net/http"
	"slices"
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
	"github.com/keelmq/keel/services/router/internal/store"
	"github.com/keelmq/keel/services/router/internal/table"
)

// Defaults.
const (
	DefaultHeartbeat  = 250 * time.Millisecond
	DefaultCacheLease = 2 * time.Second
	DefaultLeaseGrace = 250 * time.Millisecond
	// DefaultRebuildWait covers the edges' reconnect backoff (2 s at most)
	// and the full route set each sends on a new stream.
	DefaultRebuildWait = 5 * time.Second
	DefaultWildcardCap = 10000
	DefaultSendQueue   = 4096
	memberPoll         = 200 * time.Millisecond
)

// Config configures a router node.
type Config struct {
	// AdvertiseURL is the base URL other router nodes use to reach this node's
	// Connect API (http://host:port).
	AdvertiseURL string        `yaml:"advertise_url"`
	Heartbeat    time.Duration `yaml:"heartbeat"`
	CacheLease   time.Duration `yaml:"cache_lease"`
	LeaseGrace   time.Duration `yaml:"lease_grace"`
	WildcardCap  int           `yaml:"wildcard_cap"`
	SendQueue    int           `yaml:"send_queue"`
	Limits       topic.Limits  `yaml:"limits"`
	// RebuildWait is how long a node that starts a new, empty table answers
	// lookups with Unavailable while the edges register their routes again:
	// an answer from a table still being rebuilt would leave out edges whose
	// subscribers then miss acknowledged messages. The node is unsettled
	// meanwhile, so that the edges do not answer from their Bloom filters
	// and wildcard tables either (see Run).
	RebuildWait time.Duration `yaml:"rebuild_wait"`
	// SettleDelay is how long the router membership must hold still before
	// the edges are asked to re-send their route sets (see settle.go).
	SettleDelay time.Duration `yaml:"settle_delay"`
}

// RegisterFlags registers c's flags under prefix.
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.StringVar(&c.AdvertiseURL, prefix+"advertise-url", "", "base URL of this node's API for other router nodes (default: from api.addr)")
	fs.DurationVar(&c.Heartbeat, prefix+"heartbeat", DefaultHeartbeat, "RouteSync heartbeat interval")
	fs.DurationVar(&c.CacheLease, prefix+"cache-lease", DefaultCacheLease, "how long edges may trust cached route answers")
	fs.DurationVar(&c.LeaseGrace, prefix+"lease-grace", DefaultLeaseGrace, "margin added to the cache lease before the router stops waiting for an edge")
	fs.IntVar(&c.WildcardCap, prefix+"wildcard-cap", DefaultWildcardCap, "wildcard-first filters per tenant (replicated to every edge)")
	fs.IntVar(&c.SendQueue, prefix+"send-queue", DefaultSendQueue, "messages queued per edge stream before the stream is closed as too slow")
	fs.DurationVar(&c.RebuildWait, prefix+"rebuild-wait", DefaultRebuildWait, "after every router started afresh, how long lookups wait for the edges to register their routes again")
	fs.DurationVar(&c.SettleDelay, prefix+"settle-delay", DefaultSettleDelay, "after a router membership change, how long it must hold still before the edges re-send their route sets (edges send every publish to every edge until then)")
	c.Limits = routes.DefaultLimits
	fs.IntVar(&c.Limits.MaxLength, prefix+"max-filter-length", routes.DefaultLimits.MaxLength, "longest accepted filter or topic, bytes")
	fs.IntVar(&c.Limits.MaxLevels, prefix+"max-filter-levels", routes.DefaultLimits.MaxLevels, "most levels in an accepted filter or topic")
}

// Validate checks c.
func (c *Config) Validate() error {
	var errs []error
	if c.Heartbeat <= 0 || c.CacheLease <= c.Heartbeat {
		errs = append(errs, errors.New("router.heartbeat must be > 0 and below router.cache-lease"))
	}
	if c.WildcardCap < 1 || c.SendQueue < 16 {
		errs = append(errs, errors.New("router.wildcard-cap must be ≥ 1 and router.send-queue ≥ 16"))
	}
	return errors.Join(errs...)
}

func (c *Config) defaults() {
	if c.Heartbeat == 0 {
		c.Heartbeat = DefaultHeartbeat
	}
	if c.CacheLease == 0 {
		c.CacheLease = DefaultCacheLease
	}
	if c.LeaseGrace == 0 {
		c.LeaseGrace = DefaultLeaseGrace
	}
	if c.WildcardCap == 0 {
		c.WildcardCap = DefaultWildcardCap
	}
	if c.SendQueue == 0 {
		c.SendQueue = DefaultSendQueue
	}
	if c.RebuildWait == 0 {
		c.RebuildWait = DefaultRebuildWait
	}
	if c.SettleDelay == 0 {
		c.SettleDelay = DefaultSettleDelay
	}
	if c.Limits == (topic.Limits{}) {
		c.Limits = routes.DefaultLimits
	}
}

// Store is what a node needs from the embedded Olric member.
type Store interface {
	Name() string
	Get(ctx context.Context, key string) ([]byte, error)
	Put(ctx context.Context, key string, value []byte) error
	Delete(ctx context.Context, key string) error
	Scan(ctx context.Context, prefix string, fn func(key string) bool) error
	// Members lists the live members' names, sorted, and identifies the
	// membership, member restarts included (0 when unknown).
	Members(ctx context.Context) (names []string, view uint64)
}

// Key prefixes in the Olric map.
const (
	prefixAnchor = "a/" // a/<tenant>/<anchor> → table.Set of anchored routes
	prefixWild   = "w/" // w/<tenant> → table.Set of wildcard-first routes
	prefixEdge   = "e/" // e/<edge> → edgeRecord
	prefixNode   = "n/" // n/<node> → API base URL
	// keyTable marks a table that has been live: a node that finds it
	// missing starts a new, empty table (every router started afresh).
	keyTable = "m/table"
)

func anchorKey(tenant, anchor string) string { return prefixAnchor + tenant + "/" + anchor }
func wildKey(tenant string) string           { return prefixWild + tenant }

// routeKey returns the Olric key a route is stored under.
func routeKey(k routes.Key) string {
	if a := k.Anchor(); a != "" {
		return anchorKey(k.Tenant, a)
	}
	return wildKey(k.Tenant)
}

// edgeRecord is what the router keeps per edge, written by the node holding
// the edge's stream.
type edgeRecord struct {
	Inc     uint64 `json:"i"`
	Seq     uint64 `json:"s"`
	Count   uint64 `json:"n"`
	Sum     uint64 `json:"d"`
	DeadInc uint64 `json:"x,omitempty"` // routes of this and older incarnations are dead
	// SnapView is the router membership view under which the router's copy
	// of the edge's routes was last known whole (a full route set applied,
	// or a new incarnation begun): a stream under another view asks for the
	// set again, since another owner may have written over routes since.
	SnapView uint64 `json:"v,omitempty"`
}

// wildReplica is one tenant's wildcard-first routes, held by every node.
type wildReplica struct {
	set  table.Set
	trie topic.Trie[wildVal]
	// gone remembers removed routes for a while (see tombstoneTTL).
	gone map[routeEdge]tombstone
}

type wildVal struct {
	route table.Route
	edge  string
}

// Node is one router node.
type Node struct {
	cfg    Config
	logger *slog.Logger
	st     Store
	m      *metrics
	http   *http.Client

	seed     maphash.Seed
	keyLocks [256]sync.Mutex // single-writer lock stripes by route key

	mu      sync.Mutex
	members []string // live router nodes, sorted; guarded by mu
	// rebuildUntil (unix ns): lookups are refused, and the node stays
	// unsettled, until then (markTable, advanceSettle).
	rebuildUntil atomic.Int64
	// loaded: the replicas were loaded once (Run); edge streams and lookups
	// are refused before.
	loaded    atomic.Bool
	memberGen uint64      // bumped on every membership change; guarded by mu
	view      uint64      // identifies members, restarts included (Store.Members); guarded by mu
	settle    settleState // guarded by mu
	hinted    time.Time   // last unsettleEverywhere round; guarded by mu
	// applying counts route writes in flight by the memberGen they started
	// under; guarded by mu. One from an earlier membership may write over
	// routes the new owner wrote, so the edges re-send their sets only
	// after it is done.
	applying  map[uint64]int
	peerURL   map[string]string                              // node → API URL; guarded by mu
	peers     map[string]routerv1connect.RouterServiceClient // guarded by mu
	conns     map[string]*edgeConn                           // by edge ID; guarded by mu
	cachers   map[cacheKey]map[string]time.Time              // (tenant, anchor) → edge → lease end; guarded by mu
	wild      map[string]*wildReplica                        // by tenant; guarded by mu
	blooms    map[string]*bloomState                         // by tenant; guarded by mu
	dead      map[string]uint64                              // edge → highest dead incarnation; guarded by mu
	reloading bool                                           // a reload scan is running; guarded by mu
	reloadLog []*routerv1.NotifyRequest                      // wildcard and dead-edge notifications since it started; guarded by mu
	outbox    map[string]*peerOutbox                         // node → notifications it did not answer yet; guarded by mu

	// life ends when Run returns; it bounds background deliveries.
	life     context.Context
	stopLife context.CancelFunc

	wg sync.WaitGroup
}

type cacheKey struct{ tenant, anchor string }

// New builds a node over a started store.
func New(cfg Config, st Store, reg prometheus.Registerer, logger *slog.Logger) (*Node, error) {
	cfg.defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.AdvertiseURL == "" {
		return nil, errors.New("router: advertise URL is required")
	}
	if logger == nil {
		logger = logging.Discard()
	}
	life, stopLife := context.WithCancel(context.Background())
	return &Node{
		cfg: cfg, logger: logger, st: st, m: newMetrics(reg),
		outbox: map[string]*peerOutbox{}, life: life, stopLife: stopLife,
		http:    rpc.H2CClient(),
		seed:    maphash.MakeSeed(),
		peerURL: map[string]string{}, peers: map[string]routerv1connect.RouterServiceClient{},
		conns: map[string]*edgeConn{}, cachers: map[cacheKey]map[string]time.Time{},
		wild: map[string]*wildReplica{}, blooms: map[string]*bloomState{}, dead: map[string]uint64{},
		applying: map[uint64]int{},
	}, nil
}

// ID returns the node ID (its Olric member name).
func (n *Node) ID() string { return n.st.Name() }

// Run registers the node, loads its replicas and watches membership until ctx
// ends.
func (n *Node) Run(ctx context.Context, ready func()) error {
	defer n.stopLife()
	// NOTE(router): right after joining, an Olric write can hang while the
	// partition table settles; retry with a deadline per attempt.
	for attempt := 1; ; attempt++ {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		err := n.st.Put(pctx, prefixNode+n.ID(), []byte(n.cfg.AdvertiseURL))
		cancel()
		if err == nil {
			break
		}
		n.logger.Debug("register node failed; retrying", "attempt", attempt, logging.Err(err))
		select {
		case <-ctx.Done():
			return fmt.Errorf("register node: %w", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	fresh, err := n.markTable(ctx)
	if err != nil {
		return err
	}
	n.mu.Lock()
	n.members, n.view = n.st.Members(ctx)
	switch {
	case !fresh:
		// Joining a table others serve: they take this node for an owner
		// as they see it join, not all at once.
		n.unsettleLocked("router node joined")
	case n.cfg.RebuildWait > 0:
		// A new table holds only the routes registered so far, and so do
		// the Bloom filters and wildcard tables it sends the edges, which
		// answer most publishes from them without a lookup: a filter that
		// leaves out the anchor of an edge not yet registered again would
		// have that edge's subscribers miss the message. Unsettled, the
		// edges send every publish to every edge until the wait is over
		// and the route sets are in (advanceSettle).
		n.unsettleLocked("new routing table")
	default:
		n.m.settled.Set(1)
	}
	n.mu.Unlock()
	for {
		err := n.reload(ctx)
		if err == nil {
			break
		}
		n.logger.Debug("load replicas failed; retrying", logging.Err(err))
		select {
		case <-ctx.Done():
			return err
		case <-time.After(100 * time.Millisecond):
		}
	}
	n.loaded.Store(true)
	if ready != nil {
		ready()
	}
	// Settling asks the peers for their status (a second per call at most):
	// on its own goroutine, so membership polls go on meanwhile.
	n.wg.Go(func() {
		t := time.NewTicker(memberPoll)
		defer t.Stop()
		started, registered := time.Now(), time.Now()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			// Peers need this node's address to forward deltas, notify and
			// settle, and Olric can answer "not found" for a key written
			// while members joined until it is written again (a node that
			// started the table sees no membership change to do it on).
			every := 5 * time.Second
			if !n.Settled() || time.Since(started) < 30*time.Second {
				every = time.Second
			}
			if time.Since(registered) >= every {
				registered = time.Now()
				n.register(ctx)
			}
			n.advanceSettle(ctx)
		}
	})
	t := time.NewTicker(memberPoll)
	defer t.Stop()
	lastSweep := time.Now()
	for {
		select {
		case <-ctx.Done():
			n.mu.Lock()
			for _, c := range n.conns {
				c.close(errors.New("router node stopping"))
			}
			n.mu.Unlock()
			n.stopLife()
			n.wg.Wait()
			return nil
		case <-t.C:
		}
		if time.Since(lastSweep) >= n.cfg.CacheLease {
			lastSweep = time.Now()
			n.sweep(lastSweep)
		}
		ms, view := n.st.Members(ctx)
		n.mu.Lock()
		changed := len(ms) > 0 && view != n.view
		if changed {
			n.logger.Info("router membership changed", "members", ms)
			n.members = ms
			n.memberGen++
			n.view = view
			// The edges re-send their route sets once the change is over
			// (advanceSettle); until then they send to every edge.
			n.unsettleLocked("router membership changed")
		}
		n.mu.Unlock()
		if changed {
			// Register the API address again: a key written while the
			// members were still joining can read as "not found" from its
			// new owner until written again, and peers that cannot find it
			// refuse the routes they should forward here.
			n.register(ctx)
			if err := n.reload(ctx); err != nil {
				n.logger.Warn("reload replicas failed", logging.Err(err))
			}
			// A key owner that died between its write and its notification
			// left edges without the change; the reloaded replicas have it,
			// so send every edge the whole wildcard table and every filter
			// again.
			n.mu.Lock()
			for _, c := range n.conns {
				n.sendInitialLocked(c)
			}
			n.mu.Unlock()
		}
	}
}

// register writes this node's API address again (see Run).
func (n *Node) register(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := n.st.Put(pctx, prefixNode+n.ID(), []byte(n.cfg.AdvertiseURL)); err != nil {
		n.logger.Warn("registering the node again failed", logging.Err(err))
	}
}

// sweep forgets cache records whose lease ended (an anchor no edge caches
// any more needs no invalidation, and without the sweep every topic ever
// looked up would stay recorded) and old wildcard tombstones.
func (n *Node) sweep(now time.Time) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, w := range n.wild {
		w.sweep(now)
	}
	var records int
	for ck, m := range n.cachers {
		for e, until := range m {
			if !until.After(now) {
				delete(m, e)
			}
		}
		if len(m) == 0 {
			delete(n.cachers, ck)
		}
		records += len(m)
	}
	n.m.cachers.Set(float64(records))
}

// reload rebuilds the wildcard replicas, Bloom filters and dead map from the
// store and sends the edges what changed.
//
// Only one reload runs at a time (Run calls it).
func (n *Node) reload(ctx context.Context) error {
	n.mu.Lock()
	n.reloading, n.reloadLog = true, nil
	n.mu.Unlock()
	defer func() {
		n.mu.Lock()
		n.reloading, n.reloadLog = false, nil
		n.mu.Unlock()
	}()
	var wildKeys, anchorKeys, edgeKeys []string
	for _, p := range []struct {
		prefix string
		dst    *[]string
	}{{prefixWild, &wildKeys}, {prefixAnchor, &anchorKeys}, {prefixEdge, &edgeKeys}} {
		if err := n.st.Scan(ctx, p.prefix, func(k string) bool { *p.dst = append(*p.dst, k); return true }); err != nil {
			return fmt.Errorf("reload: %w", err)
		}
	}
	// NOTE(router): an Olric scan during a rebalance can miss keys, so the
	// wildcard keys of every tenant this node already knows are read with
	// Get as well (one key per tenant).
	n.mu.Lock()
	for tenant := range n.wild {
		if k := wildKey(tenant); !slices.Contains(wildKeys, k) {
			wildKeys = append(wildKeys, k)
		}
	}
	n.mu.Unlock()
	wild := map[string]*wildReplica{}
	for _, k := range wildKeys {
		s, err := n.loadSet(ctx, k)
		if err != nil {
			return err
		}
		w := &wildReplica{}
		s.Edges(func(r table.Route, e string, en table.Entry) {
			w.set.Apply(table.Delta{Edge: e, Inc: en.Inc, Seq: en.Seq, Op: table.OpAdd, Route: r, Count: en.Count})
			w.trie.Add(r.Filter, wildVal{route: r, edge: e})
		})
		wild[k[len(prefixWild):]] = w
	}
	anchors := map[string][]string{}
	for _, k := range anchorKeys {
		rest := k[len(prefixAnchor):]
		for i := 0; i < len(rest); i++ {
			if rest[i] == '/' {
				anchors[rest[:i]] = append(anchors[rest[:i]], rest[i+1:])
				break
			}
		}
	}
	dead := map[string]uint64{}
	for _, k := range edgeKeys {
		b, err := n.st.Get(ctx, k)
		if err != nil {
			continue
		}
		var rec edgeRecord
		if json.Unmarshal(b, &rec) == nil && rec.DeadInc > 0 {
			dead[k[len(prefixEdge):]] = rec.DeadInc
		}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	now := time.Now()
	// The tombstones stay: a late add can follow the reload as well.
	for tenant, old := range n.wild {
		if len(old.gone) == 0 {
			continue
		}
		w := wild[tenant]
		if w == nil {
			w = &wildReplica{}
			wild[tenant] = w
		}
		w.gone = old.gone
	}
	// Replace the wildcard replicas with what the store holds, then replay
	// the wildcard and dead-edge notifications that arrived during the scan
	// (in order; each is idempotent): a change whose notification was lost
	// with a dying key owner is in the store, and a removal the scan saw
	// must not be undone by merging in older replicas.
	for _, req := range n.reloadLog {
		applyDead(wild, req.GetInvalidation().GetDeadEdges(), now)
		applyWild(wild, req.GetWildcard(), n.dead, now)
	}
	n.wild = wild
	n.reloading, n.reloadLog = false, nil
	for e, inc := range dead {
		n.dead[e] = max(n.dead[e], inc)
	}
	for tenant, as := range anchors {
		// Anchors missed meanwhile (a notification that predates this node's
		// membership) reach edges only with the whole filter.
		if bs, fresh, added := n.addAnchorsLocked(tenant, as); fresh || added > 0 {
			for _, c := range n.conns {
				n.sendBloomLocked(c, tenant, bs)
			}
		}
	}
	var wr int
	for _, w := range n.wild {
		wr += w.trie.Len()
	}
	n.m.wildcardRoutes.Set(float64(wr))
	return nil
}

// markTable finds out whether the table is new (fresh): then lookups wait
// RebuildWait for the edges to register their routes again.
func (n *Node) markTable(ctx context.Context) (fresh bool, err error) {
	for attempt := 1; ; attempt++ {
		gctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err = n.st.Get(gctx, keyTable)
		if errors.Is(err, store.ErrNotFound) {
			err = n.st.Put(gctx, keyTable, []byte(n.ID()))
			if err == nil {
				fresh = true
				n.rebuildUntil.Store(time.Now().Add(n.cfg.RebuildWait).UnixNano())
				n.logger.Info("new routing table; lookups wait for the edges to register their routes", "wait", n.cfg.RebuildWait)
			}
		}
		cancel()
		if err == nil {
			return fresh, nil
		}
		n.logger.Debug("reading the table marker failed; retrying", "attempt", attempt, logging.Err(err))
		select {
		case <-ctx.Done():
			return false, fmt.Errorf("table marker: %w", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (n *Node) loadSet(ctx context.Context, key string) (*table.Set, error) {
	b, err := n.st.Get(ctx, key)
	if errors.Is(err, store.ErrNotFound) {
		return &table.Set{}, nil
	}
	if err != nil {
		return nil, err
	}
	return table.Unmarshal(b)
}

// rendezvous returns the node owning key among members: the highest
// rendezvous score.
func rendezvous(key string, members []string) (string, error) {
	if len(members) == 0 {
		return "", ErrNoOwner
	}
	var best string
	var bestScore uint64
	for _, m := range members {
		h := uint64(14695981039346656037)
		for _, s := range []string{m, "\x00", key} {
			for i := 0; i < len(s); i++ {
				h ^= uint64(s[i])
				h *= 1099511628211
			}
		}
		h ^= h >> 33
		h *= 0xff51afd7ed558ccd
		h ^= h >> 33
		if best == "" || h > bestScore {
			best, bestScore = m, h
		}
	}
	return best, nil
}

// peer returns an API client for router node id.
func (n *Node) peer(ctx context.Context, id string) (routerv1connect.RouterServiceClient, error) {
	n.mu.Lock()
	c := n.peers[id]
	n.mu.Unlock()
	if c != nil {
		return c, nil
	}
	b, err := n.st.Get(ctx, prefixNode+id)
	if err != nil {
		return nil, fmt.Errorf("address of router node %s: %w", id, err)
	}
	c = routerv1connect.NewRouterServiceClient(n.http, string(b), rpc.ClientOptions(connect.WithGRPC())...)
	n.mu.Lock()
	n.peers[id] = c
	n.peerURL[id] = string(b)
	n.mu.Unlock()
	return c, nil
}

func (n *Node) lockKey(key string) *sync.Mutex {
	return &n.keyLocks[maphash.String(n.seed, key)%uint64(len(n.keyLocks))]
}
