// Package app wires the edge: listeners, authentication, the MQTT broker and
// the ops endpoints, started and stopped in order.
package app

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/keelmq/keel/libs/outputclient"
	"github.com/keelmq/keel/libs/routerclient"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/cluster"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/forward"
	"github.com/keelmq/keel/services/edge/internal/listener"
	"github.com/keelmq/keel/services/edge/internal/output"
	"github.com/keelmq/keel/services/edge/internal/remotestore"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
	"github.com/keelmq/keel/services/edge/internal/tlsconf"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
)

// Config is the whole configuration of an edge process.
type Config struct {
	TCPAddr         string
	TLSAddr         string
	WSAddr          string
	WSSAddr         string
	TLSCert         string
	TLSKey          string
	TLSClientCA     string
	TLSCRL          string
	MTLS            bool
	MTLSIdentity    string
	MTLSTenant      string
	MTLSPassword    bool
	OpsAddr         string
	DataDir         string
	AuthFile        string
	Anonymous       bool
	AnonymousTenant string
	JWT             auth.JWTConfig
	Postgres        auth.PostgresConfig
	LogLevel        string
	LogFormat       string
	Pprof           bool
	// GCHeapFloor is the heap goal below which the collector does not run
	// (gcfloor); keel-edge applies it unless GOGC is set.
	GCHeapFloor uint64
	StopTimeout time.Duration
	SysInterval time.Duration
	OutputURL   string
	// Output holds the output client's queue bounds and drop-log interval;
	// its URL and identity come from OutputURL and the edge.
	Output          outputclient.Config
	CoordinatorURL  string
	RouterURL       string
	PersistenceURL  string
	APIAddr         string
	AdvertiseAddr   string
	ForwardTimeout  time.Duration
	ForwardRetry    bool
	ServerReference string
	Broker          broker.Config
	Tracing         tracing.Config
}

// RegisterFlags registers every flag of the edge.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.TCPAddr, "mqtt.tcp-addr", ":1883", "MQTT over TCP listen address (empty: off)")
	fs.StringVar(&c.TLSAddr, "mqtt.tls-addr", "", "MQTT over TLS listen address, e.g. :8883 (needs tls.cert and tls.key)")
	fs.StringVar(&c.WSAddr, "mqtt.ws-addr", ":8083", "MQTT over WebSocket listen address, path /mqtt (empty: off)")
	fs.StringVar(&c.WSSAddr, "mqtt.wss-addr", "", "MQTT over secure WebSocket listen address, e.g. :8084")
	fs.StringVar(&c.TLSCert, "tls.cert", "", "PEM certificate chain for the TLS and WSS listeners")
	fs.StringVar(&c.TLSKey, "tls.key", "", "PEM private key for the TLS and WSS listeners")
	fs.StringVar(&c.TLSClientCA, "tls.client-ca", "", "PEM CA bundle; when set, TLS clients must present a certificate it signed")
	fs.StringVar(&c.TLSCRL, "tls.crl", "", "certificate revocation list (PEM or DER) of the client CA")
	fs.BoolVar(&c.MTLS, "auth.mtls", false, "admit TLS clients by their verified certificate (needs tls.client-ca)")
	fs.StringVar(&c.MTLSIdentity, "auth.mtls.identity", "cn", "certificate field used as the user name: cn, san-dns, san-email, san-uri")
	fs.StringVar(&c.MTLSTenant, "auth.mtls.tenant", "ou", "certificate field naming the tenant: ou, o, or fixed:<tenant>")
	fs.BoolVar(&c.MTLSPassword, "auth.mtls.require-password", false, "require a valid password (auth.file) as well as the certificate")
	fs.StringVar(&c.OpsAddr, "ops.addr", ":9100", "address of /metrics, /healthz and /readyz (empty: off)")
	fs.BoolVar(&c.Pprof, "ops.pprof", false, "serve /debug/pprof on the ops address")
	fs.Uint64Var(&c.GCHeapFloor, "gc.heap-floor", 64<<20, "bytes of heap below which the Go collector does not run (0: GOGC alone; ignored when GOGC is set; GOMEMLIMIT still applies)")
	fs.StringVar(&c.DataDir, "data-dir", "data/edge", "directory for durable state: persistent sessions, queues, retained messages (empty: memory only)")
	fs.StringVar(&c.AuthFile, "auth.file", "", "YAML password file (tenants, users, bcrypt/argon2id hashes, ACLs); reloaded on change and SIGHUP")
	fs.BoolVar(&c.Anonymous, "auth.anonymous", false, "admit clients without credentials into auth.anonymous-tenant (development)")
	fs.StringVar(&c.AnonymousTenant, "auth.anonymous-tenant", tenancy.DefaultTenant, "tenant of anonymous clients")
	fs.StringVar(&c.Postgres.DSN, "auth.postgres.dsn", "", "PostgreSQL DSN of the user store (tables keel_tenants, keel_users)")
	fs.DurationVar(&c.Postgres.CacheTTL, "auth.postgres.cache-ttl", time.Minute, "how long a verified password is trusted without asking PostgreSQL (bounds revocation delay)")
	fs.BoolVar(&c.Postgres.Migrate, "auth.postgres.migrate", true, "apply the user store schema on start")
	fs.StringVar(&c.JWT.JWKSURL, "auth.jwt.jwks-url", "", "JWKS URL of an OIDC identity provider; clients send a JWT as their password")
	fs.StringVar(&c.JWT.Issuer, "auth.jwt.issuer", "", "required iss claim of tokens")
	fs.StringVar(&c.JWT.Audience, "auth.jwt.audience", "", "required aud claim of tokens")
	fs.StringVar(&c.JWT.TenantClaim, "auth.jwt.tenant-claim", "tenant", "claim that names the client's tenant")
	fs.StringVar(&c.JWT.DefaultTenant, "auth.jwt.default-tenant", "", "tenant of tokens without the tenant claim (empty: refuse them)")
	fs.StringVar(&c.JWT.UsernameClaim, "auth.jwt.username-claim", "sub", "claim used as the user name")
	fs.StringVar(&c.JWT.ACLClaim, "auth.jwt.acl-claim", "", "claim holding {publish: [...], subscribe: [...]} patterns (empty: no ACL from tokens)")
	fs.DurationVar(&c.JWT.Leeway, "auth.jwt.leeway", 30*time.Second, "clock skew tolerated on exp and nbf")
	fs.StringVar(&c.LogLevel, "log.level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log.format", "json", "log format: json or text")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", 15*time.Second, "deadline for each shutdown step")
	fs.StringVar(&c.CoordinatorURL, "cluster.coordinator", "", "URL of the coordinator API (e.g. http://keel-coordinator:7401); empty runs single-node")
	fs.StringVar(&c.RouterURL, "cluster.router", "", "URL of a router node (e.g. http://keel-router:9300); needs cluster.coordinator")
	fs.StringVar(&c.PersistenceURL, "cluster.persistence", "", "URL of the persistence service (e.g. http://keel-persistence:7402), or with K Redis groups one URL per group in group order, comma-separated: persistent sessions, queues and retained messages live there, so any edge resumes any session and a dead edge's sessions go to custodians (empty: data-dir, this edge only); needs cluster.coordinator")
	fs.StringVar(&c.APIAddr, "cluster.api-addr", ":7411", "listen address of the edge API other edges forward to (cluster mode)")
	fs.StringVar(&c.AdvertiseAddr, "cluster.advertise-addr", "", "host:port other edges reach this edge's API at (default: cluster.api-addr)")
	fs.DurationVar(&c.ForwardTimeout, "cluster.forward-timeout", 30*time.Second, "how long a QoS 1/2 publish is forwarded (and routed again while its routes name an edge that left, or with cluster.forward-retry after one left without taking it), counted from its ingress, before the publisher is closed unacknowledged")
	fs.BoolVar(&c.ForwardRetry, "cluster.forward-retry", false, "route a QoS 1/2 publish again, within cluster.forward-timeout, when an edge it went to left the cluster before taking it, instead of closing the publisher (experimental: a message routed again may reach its subscribers after newer ones of the same publisher)")
	fs.StringVar(&c.ServerReference, "cluster.server-reference", "", "server reference sent to MQTT 5 clients when this edge drains (DISCONNECT 0x9C, use another server, instead of 0x8B), e.g. the address of the MQTT load balancer; a drain through the edge API may give another")
	fs.StringVar(&c.OutputURL, "output.url", "", "URL of the output service (e.g. http://keel-output:9310); messages matching its rules go to it through a bounded queue that never blocks MQTT")
	fs.IntVar(&c.Output.QueueRecords, "output.queue-records", outputclient.DefaultQueueRecords, "most messages waiting for the output service; beyond it they are dropped (keel_edge_output_dropped_total{reason=\"queue_full\"}), never MQTT delivery slowed")
	fs.Int64Var(&c.Output.QueueBytes, "output.queue-bytes", outputclient.DefaultQueueBytes, "most payload bytes waiting for the output service")
	fs.DurationVar(&c.Output.DropLogInterval, "output.drop-log-interval", outputclient.DefaultDropLogInterval, "least time between two warnings about dropped output messages")
	fs.DurationVar(&c.SysInterval, "mqtt.sys-interval", 10*time.Second, "how often each tenant's $SYS topics are published (0: never)")
	c.Broker.RegisterFlags(fs, "mqtt.")
	c.Tracing.RegisterFlags(fs, "tracing.")
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	var errs []error
	if c.TCPAddr == "" && c.TLSAddr == "" && c.WSAddr == "" && c.WSSAddr == "" {
		errs = append(errs, errors.New("no MQTT listener: set mqtt.tcp-addr, mqtt.tls-addr, mqtt.ws-addr or mqtt.wss-addr"))
	}
	if (c.TLSAddr != "" || c.WSSAddr != "") && (c.TLSCert == "" || c.TLSKey == "") {
		errs = append(errs, errors.New("mqtt.tls-addr and mqtt.wss-addr need tls.cert and tls.key"))
	}
	if c.RouterURL != "" && c.CoordinatorURL == "" {
		errs = append(errs, errors.New("cluster.router needs cluster.coordinator"))
	}
	if c.PersistenceURL != "" && c.CoordinatorURL == "" {
		// Writes to the shared store are fenced by the coordinator's epochs.
		errs = append(errs, errors.New("cluster.persistence needs cluster.coordinator"))
	}
	if c.PersistenceURL != "" {
		for i, u := range strings.Split(c.PersistenceURL, ",") {
			if p, err := url.Parse(u); err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
				errs = append(errs, fmt.Errorf("cluster.persistence: URL %d, %.80q, is not an http(s) URL with a host", i, u))
			}
		}
	}
	if c.MTLS && c.TLSClientCA == "" {
		errs = append(errs, errors.New("auth.mtls needs tls.client-ca"))
	}
	if c.MTLSPassword && c.AuthFile == "" {
		errs = append(errs, errors.New("auth.mtls.require-password needs auth.file"))
	}
	if c.AuthFile == "" && c.Postgres.DSN == "" && c.JWT.JWKSURL == "" && !c.MTLS && !c.Anonymous {
		errs = append(errs, errors.New("no authentication: set auth.file or auth.jwt.jwks-url, or auth.anonymous=true for development"))
	}
	if c.Anonymous && !tenancy.ValidTenant(c.AnonymousTenant) {
		errs = append(errs, fmt.Errorf("auth.anonymous-tenant %q: want [a-z0-9-]{1,63}", c.AnonymousTenant))
	}
	if c.Output.QueueRecords <= 0 || c.Output.QueueBytes <= 0 || c.Output.DropLogInterval <= 0 {
		errs = append(errs, errors.New("output.queue-records, output.queue-bytes and output.drop-log-interval must be positive"))
	}
	if err := validServerReference(c.ServerReference); err != nil {
		errs = append(errs, fmt.Errorf("cluster.server-reference: %w", err))
	}
	if err := c.Broker.Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Tracing.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// openStore opens the edge's durable state: the persistence service in a
// cluster, else the data dir; nil when neither is set (memory only). With
// one persistence URL per Redis group, a session's state goes to its
// group's service by the cluster's slot table, read from the coordinator.
func openStore(cfg Config, edgeID string, logger *slog.Logger, reg prometheus.Registerer) (closingStore, error) {
	switch {
	case cfg.PersistenceURL != "":
		urls := strings.Split(cfg.PersistenceURL, ",")
		if len(urls) == 1 {
			return remotestore.New(remotestore.Config{URL: urls[0], HTTPClient: rpc.H2CClient(),
				Logger: logger.With("component", "persistence"), Registerer: reg})
		}
		table, err := fetchSlots(cfg.CoordinatorURL, edgeID, len(urls))
		if err != nil {
			return nil, err
		}
		stores := make([]*remotestore.Store, 0, len(urls))
		for g, u := range urls {
			s, err := remotestore.New(remotestore.Config{URL: u, HTTPClient: rpc.H2CClient(),
				Logger:     logger.With("component", "persistence", "group", g),
				Registerer: prometheus.WrapRegistererWith(prometheus.Labels{"group": strconv.Itoa(g)}, reg)})
			if err != nil {
				for _, s := range stores {
					_ = s.Close()
				}
				return nil, err
			}
			stores = append(stores, s)
		}
		return remotestore.NewGrouped(stores, table)
	case cfg.DataDir != "":
		if err := os.MkdirAll(cfg.DataDir, 0o750); err != nil {
			return nil, fmt.Errorf("data dir: %w", err)
		}
		return durable.Open(cfg.DataDir, logger.With("component", "durable"))
	}
	return nil, nil
}

// fetchSlots reads the cluster's slot table from the coordinator, retrying
// for a while (the coordinator may be starting beside the edge), and checks
// that the cluster has k Redis groups.
func fetchSlots(coordinatorURL, edgeID string, k int) (slots.Table, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := cluster.NewClient(coordinatorURL)
	for {
		table, groups, err := slots.Fetch(ctx, client, edgeID, coordinatorv1.MemberRole_MEMBER_ROLE_EDGE)
		if err == nil {
			if groups != k {
				return nil, fmt.Errorf("cluster.persistence lists %d URLs, one per Redis group, but the cluster has %d groups", k, groups)
			}
			return table, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("read the slot table from the coordinator: %w", err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// closingStore is the durable state the edge closes when it stops.
type closingStore interface {
	broker.DurableState
	Close() error
}

// Edge is a running edge process.
type Edge struct {
	cfg    Config
	logger *slog.Logger
	reg    *prometheus.Registry
	ops    *service.Ops
	broker *broker.Broker
	file   *auth.FileAuthenticator
	store  closingStore
	tls    *tlsconf.Config
	output *output.Sink
	member *cluster.Member
	peers  *cluster.Peers
	api    *http.Server
	// Set once the lease is held (cluster mode with a router).
	routes *routerclient.Client
	// routesClient is routes for the lease's rejoin callback, which runs
	// on another goroutine.
	routesClient atomic.Pointer[routerclient.Client]
	forwarder    *forward.Forwarder
	stopPlane    context.CancelFunc
	planeWG      sync.WaitGroup
	// lease notes until when the lease holds, for Status.
	lease *leaseClock
	// serving is set once the MQTT listeners serve.
	serving atomic.Bool
	// drainMu guards drainRun (and readiness against a drain starting).
	drainMu  sync.Mutex
	drainRun *drainRun
	drains   *prometheus.CounterVec // trigger
}

// New builds the edge: it loads credentials and TLS material and allocates,
// but listens on nothing yet.
func New(cfg Config, logger *slog.Logger) (*Edge, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Broker.EdgeID == "" {
		host, _ := os.Hostname()
		cfg.Broker.EdgeID = host
	}
	e := &Edge{cfg: cfg, logger: logger, reg: service.NewRegistry()}
	e.drains = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "keel_edge_drains_total",
		Help: "Drains of this edge by trigger: api (EdgeService.Drain, keelctl edge drain) or stop (SIGTERM without a drain before).",
	}, []string{"trigger"})
	e.reg.MustRegister(e.drains)
	var chain auth.Chain
	if cfg.AuthFile != "" {
		f, err := auth.NewFileAuthenticator(cfg.AuthFile, logger.With("component", "auth"))
		if err != nil {
			return nil, err
		}
		e.file = f
	}
	if cfg.MTLS {
		ca := auth.CertAuthenticator{IdentityFrom: cfg.MTLSIdentity, TenantFrom: cfg.MTLSTenant}
		if cfg.MTLSPassword {
			ca.Password = e.file
		}
		chain = append(chain, ca)
	}
	if e.file != nil && !cfg.MTLSPassword {
		chain = append(chain, e.file)
	}
	if cfg.Postgres.DSN != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		pg, err := auth.NewPostgresAuthenticator(ctx, cfg.Postgres, logger.With("component", "auth-postgres"))
		cancel()
		if err != nil {
			return nil, err
		}
		chain = append(chain, pg)
	}
	if cfg.JWT.JWKSURL != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		j, err := auth.NewJWTAuthenticator(ctx, cfg.JWT, logger.With("component", "auth-jwt"))
		cancel()
		if err != nil {
			return nil, err
		}
		chain = append(chain, j)
	}
	if cfg.Anonymous {
		logger.Warn("anonymous access is on: every client is admitted", "tenant", cfg.AnonymousTenant)
		chain = append(chain, auth.Anonymous{Tenant: cfg.AnonymousTenant, OnlyWithoutCredentials: cfg.AuthFile != "" || cfg.Postgres.DSN != "" || cfg.JWT.JWKSURL != "" || cfg.MTLS})
	}
	var authn auth.Authenticator = chain
	if len(chain) == 1 {
		authn = chain[0]
	}
	// A message routed here before a handover arrives at the latest when its
	// publisher's edge stops waiting for it.
	cfg.Broker.HandoverMemory = cfg.ForwardTimeout
	// A publish whose routes still name an edge that left is routed again
	// once they no longer do: nothing of it went anywhere yet, so this is
	// routing it a little later, not again.
	cfg.Broker.ResolveBound = cfg.ForwardTimeout
	if cfg.ForwardRetry {
		// Off by default: a message routed again while a session moves
		// between live edges can find the moment no edge routes it (a
		// rolling restart lost 2 acknowledged messages so, in 1 of about
		// ten runs). Closing the publisher loses nothing.
		cfg.Broker.ForwardBound = cfg.ForwardTimeout
	}
	b, err := broker.New(cfg.Broker, authn, logger.With("component", "broker"), e.reg)
	if err != nil {
		return nil, err
	}
	e.broker = b
	if cfg.OutputURL != "" {
		edgeID, inc := b.ID()
		sink, err := output.New(cfg.Output, cfg.OutputURL, edgeID, inc, logger.With("component", "output"), e.reg)
		if err != nil {
			return nil, err
		}
		e.output = sink
		b.SetCluster(broker.Cluster{Output: sink})
	}
	if cfg.CoordinatorURL != "" {
		client := cluster.NewClient(cfg.CoordinatorURL)
		edgeID, _ := b.ID()
		joins := 0
		advertise := cfg.AdvertiseAddr
		if advertise == "" {
			advertise = cfg.APIAddr
		}
		e.lease = &leaseClock{CoordinatorServiceClient: client, margin: leaseMargin}
		e.member = &cluster.Member{Client: e.lease, ID: edgeID, Address: advertise, Margin: leaseMargin,
			Logger: logger.With("component", "lease"), OnFence: b.Fence,
			OnJoin: func(inc uint64) {
				if joins++; joins > 1 {
					// A new incarnation: the sessions of the old one are
					// held elsewhere now, the router takes the routes anew
					// under it (the old one's are a dead edge's), then the
					// edge serves again.
					b.DropLapsedSessions()
					if rc := e.routesClient.Load(); rc != nil {
						rc.SetIncarnation(inc)
					}
					b.Unfence()
				}
			}}
		b.SetCluster(broker.Cluster{Ownership: &cluster.Ownership{Client: client, Member: e.member, MaxBatch: 256, Linger: time.Millisecond}})
	}
	edgeID, _ := b.ID()
	st, err := openStore(cfg, edgeID, logger, e.reg)
	if err != nil {
		return nil, err
	}
	if st != nil {
		if err := b.Restore(st); err != nil {
			_ = st.Close()
			return nil, err
		}
		e.store = st
	} else {
		logger.Warn("no data dir: sessions, queues and retained messages live in memory only")
	}
	if err := e.addListeners(); err != nil {
		e.closeStore()
		return nil, err
	}
	e.ops = service.NewOps(cfg.OpsAddr, e.reg, logger.With("component", "ops"))
	e.ops.EnablePprof = cfg.Pprof
	return e, nil
}

func (e *Edge) addListeners() error {
	var tlsCfg *tls.Config
	if e.cfg.TLSCert != "" {
		tc, err := tlsconf.Load(tlsconf.Files{Cert: e.cfg.TLSCert, Key: e.cfg.TLSKey, ClientCA: e.cfg.TLSClientCA, CRL: e.cfg.TLSCRL},
			e.logger.With("component", "tls"))
		if err != nil {
			return err
		}
		e.tls = tc
		tlsCfg = tc.TLSConfig()
	}
	add := func(l interface {
		listeners.Listener
	}) error {
		return e.broker.AddListener(l)
	}
	if e.cfg.TCPAddr != "" {
		if err := add(listener.NewTCP("tcp", e.cfg.TCPAddr, nil)); err != nil {
			return err
		}
	}
	if e.cfg.TLSAddr != "" {
		if err := add(listener.NewTCP("tls", e.cfg.TLSAddr, tlsCfg)); err != nil {
			return err
		}
	}
	if e.cfg.WSAddr != "" {
		if err := add(listeners.NewWebsocket(listeners.Config{ID: "ws", Address: e.cfg.WSAddr})); err != nil {
			return err
		}
	}
	if e.cfg.WSSAddr != "" {
		if err := add(listeners.NewWebsocket(listeners.Config{ID: "wss", Address: e.cfg.WSSAddr, TLSConfig: tlsCfg})); err != nil {
			return err
		}
	}
	return nil
}

func (e *Edge) closeStore() {
	if e.store != nil {
		if err := e.store.Close(); err != nil {
			e.logger.Error("closing durable store", "error", err)
		}
	}
}

// startDataPlane connects the edge to the router and to the other edges,
// under the incarnation its lease was granted for: routes before SUBACK,
// forwarding of publishes to the edges whose routes match, and the edge API
// the others forward to.
func (e *Edge) startDataPlane(ctx context.Context) error {
	edgeID, _ := e.broker.ID()
	inc := e.member.Incarnation()
	rc, err := routerclient.New(routerclient.Config{URL: e.cfg.RouterURL, EdgeID: edgeID, Incarnation: inc,
		HTTPClient: rpc.H2CClient(), Logger: e.logger.With("component", "routes"), Registerer: e.reg})
	if err != nil {
		return err
	}
	e.routes = rc
	e.routesClient.Store(rc)
	rc.SetIncarnation(e.member.Incarnation()) // in case the edge rejoined meanwhile
	// The lease's client: one connection to the coordinator for every call.
	e.peers = &cluster.Peers{Client: e.lease.CoordinatorServiceClient, Interval: time.Second}
	e.forwarder = &forward.Forwarder{Self: edgeID, Incarnation: e.member.Incarnation, Bound: e.cfg.ForwardTimeout, Metrics: forward.NewMetrics(e.reg),
		Resolver: cluster.Resolver{Self: edgeID, Routes: rc, Peers: e.peers}, URLs: e.peers, Redispatch: e.broker.RedispatchShared,
		Logger: e.logger.With("component", "forward")}
	fwd := &forward.Server{Deliver: e.broker, Sessions: e.broker, Custodian: e.broker, Members: e.peers, Incarnation: e.member.Incarnation,
		Logger: e.logger.With("component", "edge-api")}
	e.peers.OnGone = func(edge string) {
		e.forwarder.PeerGone(edge)
		fwd.PeerGone(edge)
		e.broker.PreviousOwnerGone(edge)
	}
	takeovers := &forward.Takeovers{Self: edgeID, Incarnation: e.member.Incarnation, Peers: e.peers}
	e.broker.SetCluster(broker.Cluster{Routes: cluster.Routes{Client: rc}, Peers: e.forwarder, Reports: fwd,
		Takeover: takeovers, Custody: &forward.Custody{Self: edgeID, Peers: e.peers, Calls: takeovers}})

	srv := &edgeAPI{Server: fwd, Kicker: e.broker, Kicks: kickCounter(e.reg), Life: e}
	mux := http.NewServeMux()
	mux.Handle(srv.Handler())
	e.api = &http.Server{Addr: e.cfg.APIAddr, Handler: mux, ReadHeaderTimeout: 10 * time.Second, Protocols: rpc.ServerProtocols(), HTTP2: rpc.ServerHTTP2()}
	ln, err := rpc.Listen(e.cfg.APIAddr)
	if err != nil {
		return fmt.Errorf("edge api: %w", err)
	}
	runCtx, cancel := context.WithCancel(context.Background())
	e.stopPlane = cancel
	watch := &cluster.Watch{Client: e.peers.Client, Self: edgeID, Incarnation: e.member.Incarnation,
		Logger: e.logger.With("component", "cluster-watch")}
	watch.ACL = e.broker
	if e.store != nil && e.store.Shared() {
		// Sessions of edges whose lease expired come here from the store.
		watch.Custodian = e.broker
		// A session claimed from an edge that then died, whose takeover
		// failed, is adopted from the store: the coordinator keeps that
		// edge's routes until it is.
		e.member.ReportClaims(e.broker)
	}
	e.member.ReportCustody(watch.AdoptedThrough)
	for _, run := range []func(context.Context) error{rc.Run, e.peers.Run, e.forwarder.Run, watch.Run} {
		e.planeWG.Add(1)
		go func() {
			defer e.planeWG.Done()
			_ = run(runCtx)
		}()
	}
	e.planeWG.Add(1)
	go func() {
		defer e.planeWG.Done()
		if err := e.api.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			e.logger.Error("edge api stopped", "error", err)
		}
	}()
	return nil
}

func (e *Edge) stopDataPlane(ctx context.Context) error {
	// Other edges' forward streams stay open as long as those edges run,
	// and Shutdown waits for them: after a short grace they are cut (this
	// edge has drained and holds no sessions any more; the senders go
	// elsewhere).
	sctx, cancel := context.WithTimeout(ctx, time.Second)
	err := e.api.Shutdown(sctx)
	cancel()
	if err != nil {
		err = e.api.Close()
	}
	if e.stopPlane != nil {
		e.stopPlane()
	}
	e.planeWG.Wait()
	return err
}

// Broker returns the MQTT broker.
func (e *Edge) Broker() *broker.Broker { return e.broker }

// Run serves until ctx ends, then stops in order: readiness off, listeners
// closed and clients sent DISCONNECT 0x8B, ops server last.
func (e *Edge) Run(ctx context.Context) error {
	var g service.Group
	g.Add("ops", func(context.Context) error { return e.ops.Start() }, e.ops.Stop)
	if e.member != nil {
		g.Add("cluster-lease", func(ctx context.Context) error {
			// Serve nothing before holding a lease.
			for {
				err := e.member.Join(ctx)
				if err == nil {
					return nil
				}
				e.logger.Warn("joining the cluster failed; retrying", "error", err)
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(time.Second):
				}
			}
		}, nil)
		g.AddRun("cluster-lease-renewal", e.member.Run)
		if e.cfg.RouterURL != "" {
			g.Add("cluster-data-plane", e.startDataPlane, e.stopDataPlane)
		}
	}
	if e.file != nil {
		g.AddRun("auth-file-watch", func(ctx context.Context) error {
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			go e.file.Watch(ctx, 2*time.Second)
			for {
				select {
				case <-ctx.Done():
					return nil
				case <-hup:
					if err := e.file.Reload(); err != nil {
						e.logger.Error("password file reload failed; keeping the previous one", "error", err)
					}
				}
			}
		})
	}
	g.Add("mqtt", func(context.Context) error {
		if err := e.broker.Serve(); err != nil {
			return err
		}
		e.serving.Store(true)
		e.drainMu.Lock()
		drained := e.drainRun != nil
		if !drained {
			e.ops.SetReady(true)
		}
		e.drainMu.Unlock()
		if drained {
			e.logger.Info("edge serving, but drained before it was ready: not ready")
			return nil
		}
		e.logger.Info("edge ready", "tcp", e.cfg.TCPAddr, "tls", e.cfg.TLSAddr, "ws", e.cfg.WSAddr, "wss", e.cfg.WSSAddr, "ops", e.ops.Addr())
		return nil
	}, func(ctx context.Context) error {
		e.ops.SetReady(false)
		if e.forwarder != nil {
			// A rolling restart loses no session: persistent ones move to
			// custodian edges before this one stops.
			e.drainAtStop(ctx)
		}
		err := e.broker.Close()
		e.closeStore()
		return err
	})
	if e.tls != nil {
		g.AddRun("tls-watch", func(ctx context.Context) error {
			e.tls.Watch(ctx.Done(), 10*time.Second)
			return nil
		})
	}
	if e.output != nil {
		g.AddRun("output", e.output.Run)
	}
	g.AddRun("load-score", func(ctx context.Context) error {
		e.broker.RunLoad(ctx)
		return nil
	})
	g.AddRun("sys", func(ctx context.Context) error {
		e.broker.RunSys(ctx, e.cfg.SysInterval)
		<-ctx.Done()
		return nil
	})
	return g.Run(ctx, e.cfg.StopTimeout, e.logger)
}

// leaseMargin is subtracted from the lease time the coordinator grants
// (clock rates differ).
const leaseMargin = time.Second

// leaseClock is the coordinator client of the edge's lease: it notes
// until when each renewal holds the lease by this edge's clock, as the
// Member reckons it (the time granted, less the margin, from when the
// renewal was sent), for Status.
type leaseClock struct {
	coordinatorv1connect.CoordinatorServiceClient
	margin time.Duration
	until  atomic.Int64 // unix nanoseconds; 0 before the first grant
}

// RenewLease implements coordinatorv1connect.CoordinatorServiceClient.
func (l *leaseClock) RenewLease(ctx context.Context, req *connect.Request[coordinatorv1.RenewLeaseRequest]) (*connect.Response[coordinatorv1.RenewLeaseResponse], error) {
	sent := time.Now()
	resp, err := l.CoordinatorServiceClient.RenewLease(ctx, req)
	if err == nil {
		if ttl := resp.Msg.GetRemainingTtl().AsDuration(); ttl > 0 {
			l.until.Store(sent.Add(ttl - l.margin).UnixNano())
		}
	}
	return resp, err
}

// remaining is how long the lease still holds at now; 0 when it lapsed.
func (l *leaseClock) remaining(now time.Time) time.Duration {
	until := l.until.Load()
	if until == 0 {
		return 0
	}
	return max(time.Unix(0, until).Sub(now), 0)
}

// drainRun is the one drain of an edge, started through the edge API or at
// stop.
type drainRun struct {
	trigger string
	done    chan struct{} // closed when the drain ended
	cancel  context.CancelFunc
}

// startDrain starts the edge's drain in the background, unless one started
// already: that one is returned, with started false. Readiness goes off
// first; the drain takes until deadline at most (the stop timeout when 0),
// and MQTT 5 clients get serverReference (the configured one when empty).
func (e *Edge) startDrain(parent context.Context, trigger string, deadline time.Duration, serverReference string) (run *drainRun, started bool) {
	e.drainMu.Lock()
	defer e.drainMu.Unlock()
	if e.drainRun != nil {
		return e.drainRun, false
	}
	e.ops.SetReady(false)
	if deadline <= 0 {
		deadline = e.cfg.StopTimeout
	}
	if serverReference == "" {
		serverReference = e.cfg.ServerReference
	}
	ctx, cancel := context.WithTimeout(parent, deadline)
	run = &drainRun{trigger: trigger, done: make(chan struct{}), cancel: cancel}
	e.drainRun = run
	e.drains.WithLabelValues(trigger).Inc()
	before := e.broker.Status()
	e.logger.Info("draining: readiness off, clients disconnected, sessions handed to custodians", "trigger", trigger,
		"deadline", deadline, "server_reference", serverReference, "connections", before.Connections,
		"sessions", before.SessionsConnected+before.SessionsOffline)
	go func() {
		defer close(run.done)
		defer cancel()
		begin := time.Now()
		moved, stayed := e.broker.DrainWith(ctx, broker.DrainOptions{ServerReference: serverReference})
		after := e.broker.Status()
		e.logger.Info("edge drained", "trigger", trigger, "duration", time.Since(begin),
			"sessions_moved", moved, "sessions_stayed", stayed, "connections_left", after.Connections,
			"sessions_left", after.SessionsConnected+after.SessionsOffline, "deadline_reached", ctx.Err() != nil)
	}()
	return run, true
}

// currentDrain returns the edge's drain, nil if none started.
func (e *Edge) currentDrain() *drainRun {
	e.drainMu.Lock()
	defer e.drainMu.Unlock()
	return e.drainRun
}

// drainAtStop drains the edge as it stops, within ctx, unless a drain
// through the edge API came first: then it waits for that one to end
// (cutting it short when ctx ends) and drains nothing again.
func (e *Edge) drainAtStop(ctx context.Context) {
	deadline := e.cfg.StopTimeout
	if d, ok := ctx.Deadline(); ok {
		deadline = time.Until(d)
	}
	run, started := e.startDrain(ctx, "stop", max(deadline, time.Millisecond), "")
	if !started {
		select {
		case <-run.done:
			e.logger.Info("stopping a drained edge: no second drain", "drained_by", run.trigger)
			return
		default:
			e.logger.Info("stopping while a drain runs: waiting for it", "drained_by", run.trigger)
		}
	}
	select {
	case <-run.done:
	case <-ctx.Done():
		run.cancel()
		select {
		case <-run.done:
		case <-time.After(time.Second):
			e.logger.Warn("drain did not end with the stop deadline; stopping anyway")
		}
	}
}

// state is the edge's life-cycle state.
func (e *Edge) state(st broker.Status) edgev1.EdgeState {
	if run := e.currentDrain(); run != nil {
		select {
		case <-run.done:
			return edgev1.EdgeState_EDGE_STATE_DRAINED
		default:
			return edgev1.EdgeState_EDGE_STATE_DRAINING
		}
	}
	if e.member != nil {
		if e.member.Incarnation() == 0 {
			return edgev1.EdgeState_EDGE_STATE_STARTING // no lease yet
		}
		if st.Fenced || !e.member.Valid() {
			return edgev1.EdgeState_EDGE_STATE_FENCED
		}
	}
	if !e.serving.Load() {
		return edgev1.EdgeState_EDGE_STATE_STARTING
	}
	return edgev1.EdgeState_EDGE_STATE_READY
}

// status implements lifecycle.
func (e *Edge) status() *edgev1.StatusResponse {
	st := e.broker.Status()
	id, inc := e.broker.ID()
	resp := &edgev1.StatusResponse{EdgeId: id, Incarnation: inc, State: e.state(st),
		Connections: clampU32(st.Connections), SessionsOwned: clampU32(st.SessionsConnected),
		SessionsInCustody: clampU32(st.SessionsOffline), Routes: clampU32(st.Routes)}
	if e.member != nil {
		resp.Incarnation = e.member.Incarnation()
		var left time.Duration
		if e.member.Valid() {
			left = e.lease.remaining(time.Now())
		}
		resp.LeaseRemaining = durationpb.New(left)
	}
	resp.Peers = e.peerStatus(id)
	return resp
}

// peerStatus lists the live peer edges and the forward links to them (and
// to edges that left since a link was made).
func (e *Edge) peerStatus(self string) []*edgev1.PeerStatus {
	byID := map[string]*edgev1.PeerStatus{}
	if e.peers != nil {
		for _, id := range e.peers.IDs() {
			if id != self {
				inc, _ := e.peers.Incarnation(id)
				byID[id] = &edgev1.PeerStatus{EdgeId: id, Incarnation: inc}
			}
		}
	}
	if e.forwarder != nil {
		for _, l := range e.forwarder.Links() {
			p := byID[l.Peer]
			if p == nil {
				p = &edgev1.PeerStatus{EdgeId: l.Peer}
				byID[l.Peer] = p
			}
			p.Connected = l.Connected && !l.Closed
			p.InflightBytes = l.InflightBytes
			p.CreditBytes = l.CreditBytes
		}
	}
	out := make([]*edgev1.PeerStatus, 0, len(byID))
	for _, p := range byID {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b *edgev1.PeerStatus) int { return strings.Compare(a.GetEdgeId(), b.GetEdgeId()) })
	return out
}

// drain implements lifecycle: the first call starts the drain, every call
// reports its progress.
func (e *Edge) drain(deadline time.Duration, serverReference string) *edgev1.DrainResponse {
	run, started := e.startDrain(context.Background(), "api", deadline, serverReference)
	if !started && (deadline > 0 || serverReference != "") {
		e.logger.Debug("drain asked again: reporting progress; deadline and server reference of the running drain stay",
			"drained_by", run.trigger)
	}
	st := e.broker.Status()
	state := edgev1.EdgeState_EDGE_STATE_DRAINING
	select {
	case <-run.done:
		state = edgev1.EdgeState_EDGE_STATE_DRAINED
	default:
	}
	return &edgev1.DrainResponse{State: state, ConnectionsRemaining: clampU32(st.Connections),
		SessionsRemaining: clampU32(st.SessionsConnected + st.SessionsOffline)}
}

func clampU32(n int) uint32 { return uint32(min(max(n, 0), math.MaxUint32)) }

// validServerReference checks a server reference for the MQTT 5 Server
// Reference property: a UTF-8 string of at most 65535 bytes without U+0000
// (MQTT 5 §1.5.4).
func validServerReference(s string) error {
	switch {
	case len(s) > math.MaxUint16:
		return fmt.Errorf("%d bytes: at most %d", len(s), math.MaxUint16)
	case !utf8.ValidString(s):
		return errors.New("not valid UTF-8")
	case strings.ContainsRune(s, 0):
		return errors.New("contains U+0000")
	}
	return nil
}
