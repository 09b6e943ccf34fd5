// Package server is the coordinator's Connect API (keel.coordinator.v1) and
// the work only the Raft leader does: leases, their expiry, custody of the
// sessions of dead edges, batching claims into Raft entries, and adding
// discovered coordinators as voters.
//
// Any node accepts any call. A follower forwards writes and linearizable reads
// to the leader once (marked with [ForwardedHeader]); a forwarded call that
// lands on a follower again is refused with Unavailable and a NotLeaderDetail,
// and the client retries with backoff.
//
// Lock order: Server.mu, then lease.Table's own lock. The FSM is read through
// immutable snapshots and needs no lock.
package server

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/services/coordinator/internal/discovery"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/lease"
	"github.com/keelmq/keel/services/coordinator/internal/raftnode"

	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
)

// ForwardedHeader marks a request a follower forwarded to the leader.
const ForwardedHeader = "Keel-Forwarded"

// Defaults of [Config].
const (
	DefaultMaxClaimsPerCall  = 1000
	DefaultMaxClaimsPerEntry = 4096
	DefaultCustodyBatch      = 1000
	DefaultWatchHeartbeat    = time.Second
	DefaultPromotionLeaseTTL = 10 * time.Second
	DefaultReconcileInterval = time.Second
	maxPipelinedEntries      = 8
)

// MaxWatchHeartbeat leaves an idle stream's heartbeats well inside the
// silence after which an edge gives a watch up (the edge's
// cluster.DefaultWatchSilence, 5 s).
const MaxWatchHeartbeat = 2 * time.Second

// Config configures the API and the leader's loops.
type Config struct {
	LeaseTTL          time.Duration `yaml:"lease_ttl"`
	MaxClaimsPerCall  int           `yaml:"max_claims_per_call"`
	MaxClaimsPerEntry int           `yaml:"max_claims_per_entry"`
	CustodyBatch      int           `yaml:"custody_batch"`
	WatchHeartbeat    time.Duration `yaml:"watch_heartbeat"`
	PromotionLeaseTTL time.Duration `yaml:"promotion_lease_ttl"`
	ReconcileInterval time.Duration `yaml:"reconcile_interval"`
	DeadServerTimeout time.Duration `yaml:"dead_server_timeout"`
	// RouterURL is a router node's API base URL, where the leader removes the
	// routes of dead edges; empty leaves them in the router.
	RouterURL string `yaml:"router_url"`
	// RouteGrace is how long after custody of a dead edge's last session the
	// leader waits before removing its routes, so that the custodians have
	// registered the adopted sessions' routes first.
	RouteGrace time.Duration `yaml:"route_grace"`
	// AdoptionWait bounds how long after custody of a dead edge's last
	// session the leader waits for its custodians to report those sessions
	// adopted (routes registered) before removing its routes anyway; 0 does
	// not wait for them.
	AdoptionWait time.Duration `yaml:"adoption_wait"`
	// MemberRetention is how long the record of a member that left or
	// expired is kept (0: forever). Members that come and go under new IDs,
	// as the pods of a Deployment do, each leave one.
	MemberRetention time.Duration `yaml:"member_retention"`
	// RedisGroups is K, the number of Redis groups persistence keeps its
	// state in, fixed at install: the first leader writes the slot table
	// for it, and a later K different from the table's is refused.
	RedisGroups int `yaml:"redis_groups"`

	// Now is the leader's clock; nil means time.Now.
	Now func() time.Time `yaml:"-"`
}

// RegisterFlags registers the flags of c under prefix.
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.DurationVar(&c.LeaseTTL, prefix+"lease-ttl", lease.DefaultTTL, "membership lease TTL; members renew every TTL/3")
	fs.IntVar(&c.MaxClaimsPerCall, prefix+"max-claims-per-call", DefaultMaxClaimsPerCall, "most claims in one ClaimSessions call")
	fs.IntVar(&c.MaxClaimsPerEntry, prefix+"max-claims-per-entry", DefaultMaxClaimsPerEntry, "most claims the leader packs into one Raft entry")
	fs.IntVar(&c.CustodyBatch, prefix+"custody-batch", DefaultCustodyBatch, "sessions per custody reassignment entry")
	fs.DurationVar(&c.WatchHeartbeat, prefix+"watch-heartbeat", DefaultWatchHeartbeat, "heartbeat interval of idle WatchCluster streams (at most 2s: edges open a watch again that brings nothing for 5s)")
	fs.DurationVar(&c.PromotionLeaseTTL, prefix+"promotion-lease-ttl", DefaultPromotionLeaseTTL, "default TTL of a Redis group promotion lease")
	fs.DurationVar(&c.ReconcileInterval, prefix+"reconcile-interval", DefaultReconcileInterval, "how often the leader adds discovered coordinators as voters")
	fs.DurationVar(&c.DeadServerTimeout, prefix+"dead-server-timeout", 0, "remove a voter missing from gossip this long, if a majority stays (0: never)")
	fs.StringVar(&c.RouterURL, prefix+"router.url", "", "API base URL of a router node (e.g. http://keel-router:9300), where the leader removes dead edges' routes (empty: they are never removed)")
	fs.DurationVar(&c.RouteGrace, prefix+"custody.route-grace", DefaultRouteGrace, "after a dead edge's last session was adopted, wait this long for the custodians to register its routes before removing the dead edge's")
	fs.DurationVar(&c.AdoptionWait, prefix+"custody.adoption-wait", DefaultAdoptionWait, "after a dead edge's last session was given to custodians, wait at most this long for them to report the sessions adopted (their routes registered) before removing the dead edge's routes; publishes to those sessions are not acknowledged meanwhile")
	fs.IntVar(&c.RedisGroups, prefix+"redis.groups", 1, "K, the number of Redis groups, fixed at install: the first leader maps the 16384 slots to K groups in equal runs, and a coordinator started later with another K logs an error and keeps the table")
	fs.DurationVar(&c.MemberRetention, prefix+"members.retention", DefaultMemberRetention, "keep the record of a member that left or expired this long, then delete it once no session or promotion lease refers to it (0: keep forever; at least 10 lease TTLs)")
}

// DefaultMemberRetention is the default of Config.MemberRetention.
const DefaultMemberRetention = 24 * time.Hour

// Validate checks c.
func (c *Config) Validate() error {
	var errs []error
	if c.RedisGroups < 0 || c.RedisGroups > slots.Count {
		errs = append(errs, fmt.Errorf("redis.groups must be between 1 and %d", slots.Count))
	}
	if c.LeaseTTL < 30*time.Millisecond {
		errs = append(errs, errors.New("lease ttl must be at least 30ms"))
	}
	if c.MaxClaimsPerCall <= 0 || c.MaxClaimsPerEntry <= 0 || c.CustodyBatch <= 0 {
		errs = append(errs, errors.New("claim and custody batch sizes must be positive"))
	}
	if c.WatchHeartbeat <= 0 || c.ReconcileInterval <= 0 {
		errs = append(errs, errors.New("watch heartbeat and reconcile interval must be positive"))
	}
	if c.WatchHeartbeat > MaxWatchHeartbeat {
		errs = append(errs, fmt.Errorf("watch heartbeat must be at most %s: edges open a watch again that brings nothing for 5s", MaxWatchHeartbeat))
	}
	if c.PromotionLeaseTTL <= 0 || c.PromotionLeaseTTL.Nanoseconds() > fsm.MaxPromotionLeaseTTL {
		errs = append(errs, errors.New("promotion lease ttl must be in (0, 60s]"))
	}
	if c.DeadServerTimeout < 0 {
		errs = append(errs, errors.New("dead server timeout must not be negative"))
	}
	if c.RouteGrace < 0 || c.AdoptionWait < 0 {
		errs = append(errs, errors.New("custody route grace and adoption wait must not be negative"))
	}
	if c.MemberRetention != 0 && c.MemberRetention < 10*c.LeaseTTL {
		// A process may run on under its lapsed lease until it notices;
		// its incarnation's record must outlive that by far.
		errs = append(errs, errors.New("member retention must be 0 (forever) or at least 10 lease TTLs"))
	}
	if c.RouterURL != "" {
		if u, err := url.Parse(c.RouterURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			errs = append(errs, fmt.Errorf("router url %q: want http(s)://host:port", c.RouterURL))
		}
	}
	return errors.Join(errs...)
}

// Peers resolves coordinators found by gossip.
type Peers interface {
	Coordinators() []discovery.Member
}

// Server implements coordinatorv1connect.CoordinatorServiceHandler.
type Server struct {
	cfg     Config
	logger  *slog.Logger
	node    *raftnode.Node
	fsm     *fsm.FSM
	peers   Peers
	metrics *metrics
	hub     *hub
	now     func() time.Time
	httpc   *http.Client
	router  routerv1connect.RouterServiceClient // nil without Config.RouterURL
	// refusedLog limits the lines logged for refused claims and releases.
	refusedLog logging.Every

	// term is the leader's state for the current term; nil on followers and
	// while a new leader is not ready.
	term atomic.Pointer[leaderTerm]

	clientsMu sync.Mutex
	clients   map[string]coordinatorv1connect.CoordinatorServiceClient // by base URL; guarded by clientsMu
}

var _ coordinatorv1connect.CoordinatorServiceHandler = (*Server)(nil)

// New builds the server; [Server.Run] starts its loops.
func New(cfg Config, node *raftnode.Node, peers Peers, reg prometheus.Registerer, logger *slog.Logger) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = logging.Discard()
	}
	s := &Server{
		cfg:     cfg,
		logger:  logger.With(logging.KeyComponent, "coordinator"),
		node:    node,
		fsm:     node.FSM(),
		peers:   peers,
		now:     cfg.Now,
		httpc:   newHTTPClient(),
		clients: map[string]coordinatorv1connect.CoordinatorServiceClient{},
	}
	if s.now == nil {
		s.now = time.Now
	}
	if cfg.RouterURL != "" {
		s.router = routerv1connect.NewRouterServiceClient(s.httpc, strings.TrimRight(cfg.RouterURL, "/"), rpc.ClientOptions(connect.WithGRPC())...)
	} else {
		s.logger.Warn("no router.url: the routes of dead edges stay in the router, and publishers keep forwarding to them")
	}
	s.metrics = newMetrics(reg, s)
	s.hub = newHub(s.fsm)
	s.fsm.SetObserver(s.observe)
	return s, nil
}

// Handler returns the Connect handler's path and HTTP handler.
func (s *Server) Handler(opts ...connect.HandlerOption) (string, http.Handler) {
	return coordinatorv1connect.NewCoordinatorServiceHandler(s, rpc.HandlerOptions(opts...)...)
}

// observe runs on the FSM's apply goroutine for every entry with events.
func (s *Server) observe(index uint64, events []fsm.Event) {
	s.hub.publish(index, events)
	if t := s.term.Load(); t != nil {
		t.observe(index, events)
	}
}

// Run follows leadership until ctx is done: on every gain it runs the leader's
// loops for that term, and stops them on loss.
func (s *Server) Run(ctx context.Context) error {
	type running struct {
		cancel context.CancelFunc
		done   chan struct{}
	}
	var cur *running
	stop := func() {
		if cur != nil {
			cur.cancel()
			<-cur.done
			cur = nil
		}
	}
	defer stop()
	check := time.NewTicker(250 * time.Millisecond)
	defer check.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.node.LeaderCh():
		case <-check.C:
		}
		// NotifyCh keeps only the latest value, so act on the current state,
		// not on the notification.
		leader := s.node.IsLeader()
		switch {
		case leader && cur == nil:
			s.metrics.leaderChanges.Inc()
			lctx, cancel := context.WithCancel(ctx)
			r := &running{cancel: cancel, done: make(chan struct{})}
			cur = r
			go func() {
				defer close(r.done)
				s.leaderLoop(lctx)
			}()
		case !leader && cur != nil:
			s.metrics.leaderChanges.Inc()
			stop()
		}
	}
}

// Ready reports nil when this node knows a leader and its FSM has applied
// everything it knows to be committed.
func (s *Server) Ready() error {
	id, _ := s.node.Leader()
	if id == "" {
		return ErrNoLeader
	}
	r := s.node.Raft()
	if r == nil {
		return ErrNotReady
	}
	if applied, commit := r.AppliedIndex(), r.CommitIndex(); applied < commit {
		return errors.New("fsm behind commit index")
	}
	if s.node.IsLeader() && s.term.Load() == nil {
		return ErrNotReady
	}
	return nil
}

// apiURL returns the Connect base URL of coordinator id, from gossip.
func (s *Server) apiURL(id string) string {
	if id == "" || s.peers == nil {
		return ""
	}
	for _, m := range s.peers.Coordinators() {
		if m.Meta.ID == id && m.Meta.APIAddr != "" {
			return "http://" + m.Meta.APIAddr
		}
	}
	return ""
}

func (s *Server) client(url string) coordinatorv1connect.CoordinatorServiceClient {
	s.clientsMu.Lock()
	defer s.clientsMu.Unlock()
	c, ok := s.clients[url]
	if !ok {
		c = coordinatorv1connect.NewCoordinatorServiceClient(s.httpc, url, rpc.ClientOptions()...)
		s.clients[url] = c
	}
	return c
}

// leaderClient returns a client of the current leader for forwarding, or an
// error if this call was already forwarded or no leader is known.
func (s *Server) leaderClient(h http.Header, procedure string) (coordinatorv1connect.CoordinatorServiceClient, error) {
	if h.Get(ForwardedHeader) != "" {
		return nil, ErrForwardLoop
	}
	id, _ := s.node.Leader()
	if id == "" || id == s.node.ID() {
		return nil, ErrNoLeader
	}
	url := s.apiURL(id)
	if url == "" {
		return nil, ErrNoLeader
	}
	s.metrics.forwarded.WithLabelValues(procedure).Inc()
	return s.client(url), nil
}

// forward sends req to the leader with the forwarded mark.
func forward[Req, Resp any](ctx context.Context, s *Server, in *connect.Request[Req],
	call func(coordinatorv1connect.CoordinatorServiceClient, context.Context, *connect.Request[Req]) (*connect.Response[Resp], error),
) (*connect.Response[Resp], error) {
	c, err := s.leaderClient(in.Header(), in.Spec().Procedure)
	if err != nil {
		return nil, s.toConnect(err)
	}
	out := connect.NewRequest(in.Msg)
	out.Header().Set(ForwardedHeader, s.node.ID())
	return call(c, ctx, out)
}

func newHTTPClient() *http.Client { return rpc.H2CClient() }
