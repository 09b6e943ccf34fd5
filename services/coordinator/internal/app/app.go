// Package app wires the coordinator: ops endpoints, Raft, gossip, the Connect
// API, the leader's loops and bootstrap, started in that order and stopped in
// reverse.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/coordinator/internal/discovery"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftnode"
	"github.com/keelmq/keel/services/coordinator/internal/server"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

// Config is the whole configuration of a coordinator process.
type Config struct {
	APIAddr          string        `yaml:"api_addr"`
	APIAdvertiseAddr string        `yaml:"api_advertise_addr"`
	OpsAddr          string        `yaml:"ops_addr"`
	Pprof            bool          `yaml:"pprof"`
	LogLevel         string        `yaml:"log_level"`
	LogFormat        string        `yaml:"log_format"`
	StopTimeout      time.Duration `yaml:"stop_timeout"`
	DrainDelay       time.Duration `yaml:"drain_delay"`

	Raft   raftnode.Config  `yaml:"raft"`
	Gossip discovery.Config `yaml:"gossip"`
	Server server.Config    `yaml:"server"`

	// APIListener, if set, is served instead of binding APIAddr (tests).
	APIListener net.Listener `yaml:"-"`
	// Registry, if set, receives the metrics instead of a new registry (tests).
	Registry *prometheus.Registry `yaml:"-"`
	Tracing  tracing.Config
}

// RegisterFlags registers every flag of the coordinator.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.APIAddr, "api.addr", ":7401", "Connect API listen address (gRPC, gRPC-Web and Connect; HTTP/1.1 and h2c)")
	fs.StringVar(&c.APIAdvertiseAddr, "api.advertise-addr", "", "API address peers and forwarded calls use (default: derived from api.addr)")
	fs.StringVar(&c.OpsAddr, "ops.addr", ":9101", "address of /metrics, /healthz and /readyz (empty: off)")
	fs.BoolVar(&c.Pprof, "ops.pprof", false, "serve /debug/pprof on the ops address")
	fs.StringVar(&c.LogLevel, "log.level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log.format", "json", "log format: json or text")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", 10*time.Second, "deadline for each shutdown step")
	fs.DurationVar(&c.DrainDelay, "drain-delay", 0, "time between failing /readyz and closing the API on shutdown")
	c.Raft.RegisterFlags(fs, "raft.")
	c.Gossip.RegisterFlags(fs, "gossip.")
	c.Server.RegisterFlags(fs, "")
	c.Tracing.RegisterFlags(fs, "tracing.")
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	var errs []error
	if err := c.Tracing.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.APIAddr == "" && c.APIListener == nil {
		errs = append(errs, errors.New("api.addr is empty"))
	}
	if c.StopTimeout <= 0 || c.DrainDelay < 0 {
		errs = append(errs, errors.New("stop-timeout must be positive and drain-delay not negative"))
	}
	if _, err := logging.ParseLevel(c.LogLevel); err != nil {
		errs = append(errs, err)
	}
	raftCfg := c.Raft
	if raftCfg.NodeID == "" {
		raftCfg.NodeID = "placeholder" // defaulted from the hostname in New
	}
	for _, err := range []error{raftCfg.Validate(), c.Gossip.Validate(), c.Server.Validate()} {
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// App is a coordinator process.
type App struct {
	cfg    Config
	logger *slog.Logger
	reg    *prometheus.Registry
	ops    *service.Ops
	fsm    *fsm.FSM
	node   *raftnode.Node
	disc   *discovery.Discovery
	srv    *server.Server
	apiLn  net.Listener
	apiURL string
	http   *http.Server
}

// New builds the coordinator: it opens the Raft stores and binds the Raft and
// API listeners, so their addresses are known, but starts nothing.
func New(cfg Config, logger *slog.Logger) (*App, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Raft.NodeID == "" {
		host, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("node id from hostname: %w", err)
		}
		cfg.Raft.NodeID = host
	}
	a := &App{cfg: cfg, logger: logger, reg: cfg.Registry}
	if a.reg == nil {
		a.reg = service.NewRegistry()
	}
	a.fsm = fsm.New(logger.With(logging.KeyComponent, "fsm"))
	node, err := raftnode.New(cfg.Raft, a.fsm, logger)
	if err != nil {
		return nil, err
	}
	a.node = node
	ln := cfg.APIListener
	if ln == nil {
		if ln, err = net.Listen("tcp", cfg.APIAddr); err != nil {
			_ = node.Kill()
			return nil, fmt.Errorf("listen api %s: %w", cfg.APIAddr, err)
		}
	}
	ln = rpc.Buffered(ln)
	a.apiLn = ln
	adv, err := raftnode.AdvertiseAddr(cfg.APIAdvertiseAddr, ln.Addr())
	if err != nil {
		_ = ln.Close()
		_ = node.Kill()
		return nil, err
	}
	a.apiURL = "http://" + adv.String()
	a.disc, err = discovery.New(cfg.Gossip, discovery.Meta{Role: discovery.RoleCoordinator, ID: cfg.Raft.NodeID,
		RaftAddr: node.Addr(), APIAddr: adv.String(), Commands: int(fsm.NewestCommand)}, logger)
	if err != nil {
		_ = ln.Close()
		_ = node.Kill()
		return nil, err
	}
	a.srv, err = server.New(cfg.Server, node, a.disc, a.reg, logger)
	if err != nil {
		_ = ln.Close()
		_ = node.Kill()
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle(a.srv.Handler(connect.WithReadMaxBytes(4 << 20)))
	// Shutdown does not end server streams (WatchCluster); cancelling their
	// base context when it starts does, so the stop step is not held up.
	apiCtx, apiCancel := context.WithCancel(context.Background())
	a.http = &http.Server{Handler: mux, Protocols: rpc.ServerProtocols(), HTTP2: rpc.ServerHTTP2(), ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:    slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		BaseContext: func(net.Listener) context.Context { return apiCtx }}
	a.http.RegisterOnShutdown(apiCancel)
	a.ops = service.NewOps(cfg.OpsAddr, a.reg, logger)
	a.ops.EnablePprof = cfg.Pprof
	a.ops.AddReadyCheck("raft", a.srv.Ready)
	return a, nil
}

// Node returns the Raft node (tests and status).
func (a *App) Node() *raftnode.Node { return a.node }

// FSM returns the state machine.
func (a *App) FSM() *fsm.FSM { return a.fsm }

// APIURL returns the Connect base URL of this coordinator.
func (a *App) APIURL() string { return a.apiURL }

// GossipAddr returns the memberlist address others join; valid after start.
func (a *App) GossipAddr() string { return a.disc.Addr() }

// Ops returns the ops server.
func (a *App) Ops() *service.Ops { return a.ops }

// Run starts every component and blocks until ctx is done, then stops them in
// reverse order: fail /readyz, stop bootstrap and the leader's loops, close the
// API, leave gossip, transfer leadership and stop Raft, stop the ops server.
func (a *App) Run(ctx context.Context) error {
	var g service.Group
	g.Add("ops", func(context.Context) error { return a.ops.Start() }, a.ops.Stop)
	g.Add("raft", func(context.Context) error { return a.node.Start() }, a.node.Shutdown)
	g.Add("gossip", func(context.Context) error { return a.disc.Start() },
		func(ctx context.Context) error { return a.disc.Stop(timeLeft(ctx)) })
	apiDone := make(chan struct{})
	g.Add("api", func(context.Context) error {
		go func() {
			defer close(apiDone)
			if err := a.http.Serve(a.apiLn); !errors.Is(err, http.ErrServerClosed) {
				a.logger.Error("api server failed", logging.Err(err))
			}
		}()
		a.logger.Info("api listening", "addr", a.apiLn.Addr().String(), "url", a.apiURL)
		return nil
	}, func(ctx context.Context) error {
		err := a.http.Shutdown(ctx)
		if err != nil {
			_ = a.http.Close()
		}
		<-apiDone
		return err
	})
	g.AddRun("leader", a.srv.Run)
	g.AddRun("bootstrap", a.bootstrap)
	g.Add("ready", func(context.Context) error { a.ops.SetReady(true); return nil }, func(ctx context.Context) error {
		a.ops.SetReady(false)
		select {
		case <-time.After(a.cfg.DrainDelay):
		case <-ctx.Done():
		}
		return nil
	})
	return g.Run(ctx, a.cfg.StopTimeout, a.logger)
}

func timeLeft(ctx context.Context) time.Duration {
	if dl, ok := ctx.Deadline(); ok {
		return max(time.Until(dl), 0)
	}
	return 5 * time.Second
}

// bootstrap forms a new cluster once BootstrapExpect coordinators are visible
// in gossip, like Consul's bootstrap-expect. It never bootstraps a node with
// Raft state, nor when any discovered peer already has a term or a leader (it
// is then added as a voter by that leader). It blocks until ctx is done, as a
// [service.Group] run component must.
func (a *App) bootstrap(ctx context.Context) error {
	expect := a.cfg.Raft.BootstrapExpect
	if has, err := a.node.HasState(); err != nil || has || expect == 0 {
		if err != nil {
			a.logger.Error("cannot read raft state", logging.Err(err))
		}
		<-ctx.Done()
		return nil
	}
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-a.disc.Changed():
		case <-tick.C:
		}
		if id, _ := a.node.Leader(); id != "" {
			<-ctx.Done() // joined an existing cluster
			return nil
		}
		peers := a.disc.Coordinators()
		if len(peers) < expect || !a.peersFresh(ctx, peers) {
			continue
		}
		servers := make([]raft.Server, 0, len(peers))
		for _, p := range peers {
			servers = append(servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.Meta.ID), Address: raft.ServerAddress(p.Meta.RaftAddr)})
		}
		if _, err := a.node.BootstrapIfEmpty(servers); err != nil {
			a.logger.Error("bootstrap failed", logging.Err(err))
			continue
		}
		<-ctx.Done()
		return nil
	}
}

// peersFresh asks every other peer for its status and reports whether none of
// them is in a cluster already.
func (a *App) peersFresh(ctx context.Context, peers []discovery.Member) bool {
	for _, p := range peers {
		if p.Meta.ID == a.cfg.Raft.NodeID {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		c := coordinatorv1connect.NewCoordinatorServiceClient(http.DefaultClient, "http://"+p.Meta.APIAddr, rpc.ClientOptions()...)
		resp, err := c.Status(cctx, connect.NewRequest(&coordinatorv1.StatusRequest{}))
		cancel()
		if err != nil {
			return false
		}
		if resp.Msg.GetTerm() > 0 || resp.Msg.GetLeaderId() != "" {
			a.logger.Info("peer already in a cluster, not bootstrapping", "peer", p.Meta.ID)
			return false
		}
	}
	return true
}
