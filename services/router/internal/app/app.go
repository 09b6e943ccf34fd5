// Package app wires a router node: the embedded Olric member, the router
// node, its Connect API and the ops endpoints, started and stopped in order.
package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
	"github.com/keelmq/keel/services/router/internal/server"
	"github.com/keelmq/keel/services/router/internal/store"
)

// Config is the whole configuration of a router process.
type Config struct {
	APIAddr     string
	OpsAddr     string
	LogLevel    string
	LogFormat   string
	StopTimeout time.Duration
	Olric       store.Config
	Router      server.Config
	Tracing     tracing.Config
}

// RegisterFlags registers every flag.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.APIAddr, "api.addr", ":9300", "Connect/gRPC API listen address (h2c)")
	fs.StringVar(&c.OpsAddr, "ops.addr", ":9101", "address of /metrics, /healthz and /readyz (empty: off)")
	fs.StringVar(&c.LogLevel, "log.level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log.format", "json", "log format: json or text")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", 15*time.Second, "deadline for each shutdown step")
	c.Olric.RegisterFlags(fs, "olric.")
	c.Router.RegisterFlags(fs, "router.")
	c.Tracing.RegisterFlags(fs, "tracing.")
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	var errs []error
	if err := c.Tracing.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.APIAddr == "" {
		errs = append(errs, errors.New("api.addr is required"))
	}
	errs = append(errs, c.Olric.Validate(), c.Router.Validate())
	return errors.Join(errs...)
}

// Router is a running router process.
type Router struct {
	cfg    Config
	logger *slog.Logger
	reg    *prometheus.Registry
	ops    *service.Ops
	st     *store.Store
}

// New builds the process; nothing listens yet.
func New(cfg Config, logger *slog.Logger) (*Router, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	st, err := store.New(cfg.Olric, logger.With(logging.KeyComponent, "olric"))
	if err != nil {
		return nil, err
	}
	r := &Router{cfg: cfg, logger: logger, reg: service.NewRegistry(), st: st}
	r.ops = service.NewOps(cfg.OpsAddr, r.reg, logger)
	return r, nil
}

// Run serves until ctx ends, then stops in reverse order.
func (r *Router) Run(ctx context.Context) error {
	ln, err := rpc.Listen(r.cfg.APIAddr)
	if err != nil {
		return fmt.Errorf("listen api: %w", err)
	}
	if r.cfg.Router.AdvertiseURL == "" {
		// The resolved Olric bind address, the IP the other router nodes
		// already reach this one on; not the flag as given (0.0.0.0, or a
		// host name they might resolve differently).
		_, port, _ := net.SplitHostPort(ln.Addr().String())
		r.cfg.Router.AdvertiseURL = "http://" + net.JoinHostPort(r.st.Host(), port)
	}
	var g service.Group
	g.Add("ops", func(context.Context) error { return r.ops.Start() }, r.ops.Stop)
	g.Add("olric", r.st.Start, r.st.Stop)
	var node *server.Node
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Protocols: rpc.ServerProtocols(), HTTP2: rpc.ServerHTTP2()}
	g.Add("api", func(context.Context) error {
		node, err = server.New(r.cfg.Router, r.st, r.reg, r.logger.With(logging.KeyComponent, "router"))
		if err != nil {
			return err
		}
		mux := http.NewServeMux()
		mux.Handle(routerv1connect.NewRouterServiceHandler(node, rpc.HandlerOptions()...))
		srv.Handler = mux
		go func() { _ = srv.Serve(ln) }()
		return nil
	}, func(ctx context.Context) error {
		r.ops.SetReady(false)
		return srv.Shutdown(ctx)
	})
	g.AddRun("router", func(ctx context.Context) error {
		return node.Run(ctx, func() {
			r.ops.SetReady(true)
			r.logger.Info("router ready", "node", node.ID(), "api", ln.Addr().String(), "ops", r.ops.Addr())
		})
	})
	return g.Run(ctx, r.cfg.StopTimeout, r.logger)
}
