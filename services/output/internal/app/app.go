// Package app wires the output service: the rules file and its watcher, the
// pipeline host and its plugins, the Connect API and the ops endpoints,
// started and stopped in order.
package app

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/output/internal/pipeline"
	"github.com/keelmq/keel/services/output/internal/rules"
	"github.com/keelmq/keel/services/output/internal/server"
)

// Config is the whole configuration of an output process.
type Config struct {
	ListenAddr   string
	OpsAddr      string
	MemberID     string
	RulesFile    string
	PluginDir    string
	PollInterval time.Duration
	CreditBytes  uint64
	LogLevel     string
	LogFormat    string
	Pprof        bool
	StopTimeout  time.Duration
	DrainTimeout time.Duration
	Pipeline     pipeline.Config
	Tracing      tracing.Config
}

// RegisterFlags registers every flag of the output service.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.ListenAddr, "listen-addr", ":9310", "address of the Connect API (gRPC, gRPC-Web and Connect; h2c) that edges stream to")
	fs.StringVar(&c.OpsAddr, "ops.addr", ":9110", "address of /metrics, /healthz and /readyz (empty: off)")
	fs.BoolVar(&c.Pprof, "ops.pprof", false, "serve /debug/pprof on the ops address")
	fs.StringVar(&c.MemberID, "member-id", "", "ID of this instance (default: host name)")
	fs.StringVar(&c.RulesFile, "rules.file", "", "YAML rules file (tenants → rules → transforms → sink); reloaded on change and SIGHUP")
	fs.DurationVar(&c.PollInterval, "rules.poll-interval", 2*time.Second, "how often the rules file is checked for changes (0: only on SIGHUP)")
	fs.StringVar(&c.PluginDir, "plugin-dir", "", "directory of keel-output-<id> plugin binaries (default: the directory of this binary)")
	fs.Uint64Var(&c.CreditBytes, "credit-bytes", server.DefaultCreditBytes, "in-flight window granted to each edge stream, in payload bytes")
	fs.StringVar(&c.LogLevel, "log.level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log.format", "json", "log format: json or text")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", 15*time.Second, "deadline for each shutdown step")
	fs.DurationVar(&c.DrainTimeout, "drain-timeout", 10*time.Second, "on shutdown, how long pipelines keep delivering their buffers")
	fs.DurationVar(&c.Pipeline.BackoffMin, "plugin.backoff-min", pipeline.DefaultBackoffMin, "first delay before retrying a batch or restarting a plugin")
	fs.DurationVar(&c.Pipeline.BackoffMax, "plugin.backoff-max", pipeline.DefaultBackoffMax, "largest delay between retries and restarts")
	fs.DurationVar(&c.Pipeline.CallTimeout, "plugin.call-timeout", pipeline.DefaultCallTimeout, "deadline of configure/transform calls; a plugin overrunning it is killed and restarted")
	fs.DurationVar(&c.Pipeline.StartTimeout, "plugin.start-timeout", 10*time.Second, "deadline of a plugin's launch handshake")
	fs.DurationVar(&c.Pipeline.DrainTimeout, "rules.drain-timeout", pipeline.DefaultDrainTimeout, "how long a deleted rule keeps delivering its buffer")
	c.Tracing.RegisterFlags(fs, "tracing.")
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	var errs []error
	if err := c.Tracing.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.ListenAddr == "" {
		errs = append(errs, errors.New("listen-addr is required"))
	}
	if c.RulesFile == "" {
		errs = append(errs, errors.New("rules.file is required"))
	}
	if c.PollInterval < 0 || c.StopTimeout < 0 || c.DrainTimeout < 0 {
		errs = append(errs, errors.New("durations must not be negative"))
	}
	if _, err := logging.ParseLevel(c.LogLevel); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (c *Config) ruleOptions() rules.Options {
	dir := c.PluginDir
	if dir == "" {
		if exe, err := os.Executable(); err == nil {
			dir = filepath.Dir(exe)
		}
	}
	return rules.Options{PluginDir: dir}
}

// CheckRules loads and validates the rules file as the service would.
func (c *Config) CheckRules() (*rules.Set, error) {
	return rules.Load(c.RulesFile, c.ruleOptions())
}

// Output is a running output process.
type Output struct {
	cfg     Config
	logger  *slog.Logger
	reg     *prometheus.Registry
	ops     *service.Ops
	host    *pipeline.Host
	handler *server.Handler
	initial *rules.Set

	reloadMu sync.Mutex // serialises reloads
	lastSum  [32]byte   // guarded by reloadMu: hash of the file last tried

	mu      sync.Mutex
	srv     *http.Server
	ln      net.Listener
	apiDone chan struct{} // closed when the API serve goroutine returns
}

// New validates the configuration and loads the rules; it starts nothing.
func New(cfg Config, logger *slog.Logger) (*Output, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MemberID == "" {
		cfg.MemberID, _ = os.Hostname()
	}
	data, err := os.ReadFile(cfg.RulesFile)
	if err != nil {
		return nil, fmt.Errorf("read rules: %w", err)
	}
	set, err := parseRules(&cfg, data)
	if err != nil {
		return nil, err
	}
	o := &Output{cfg: cfg, logger: logger, reg: service.NewRegistry(), initial: set, lastSum: sha256.Sum256(data)}
	o.host = pipeline.NewHost(cfg.Pipeline, logger.With(logging.KeyComponent, "pipeline"), pipeline.NewMetrics(o.reg))
	o.handler = server.New(o.host, cfg.MemberID, cfg.CreditBytes, logger.With(logging.KeyComponent, "api"))
	o.ops = service.NewOps(cfg.OpsAddr, o.reg, logger.With(logging.KeyComponent, "ops"))
	o.ops.EnablePprof = cfg.Pprof
	return o, nil
}

func parseRules(cfg *Config, data []byte) (*rules.Set, error) {
	opts := cfg.ruleOptions()
	if opts.PluginDir == "" {
		opts.PluginDir = filepath.Dir(cfg.RulesFile)
	}
	return rules.Parse(cfg.RulesFile, data, opts)
}

// Registry is the metrics registry (for tests).
func (o *Output) Registry() *prometheus.Registry { return o.reg }

// Host is the pipeline host (for tests).
func (o *Output) Host() *pipeline.Host { return o.host }

// Addr is the Connect API's bound address once Run has started it.
func (o *Output) Addr() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ln == nil {
		return ""
	}
	return o.ln.Addr().String()
}

// OpsAddr is the ops server's bound address.
func (o *Output) OpsAddr() string { return o.ops.Addr() }

// Reload re-reads the rules file and applies it if it changed (or always,
// with force). A bad file or a plugin that fails to start leaves the running
// rules in place; the error says why.
func (o *Output) Reload(ctx context.Context, force bool) error {
	o.reloadMu.Lock()
	defer o.reloadMu.Unlock()
	data, err := os.ReadFile(o.cfg.RulesFile)
	if err != nil {
		return fmt.Errorf("read rules: %w", err)
	}
	sum := sha256.Sum256(data)
	if !force && bytes.Equal(sum[:], o.lastSum[:]) {
		return nil
	}
	o.lastSum = sum
	set, err := parseRules(&o.cfg, data)
	if err != nil {
		o.host.NoteReloadFailure()
	} else {
		err = o.host.Apply(ctx, set)
	}
	if err != nil {
		o.logger.Error("rules not applied, keeping the running rules", logging.Err(err))
		return err
	}
	o.logger.Info("rules applied", "rules", len(set.Pipelines))
	return nil
}

// Run starts everything, blocks until ctx ends, then stops in reverse order.
func (o *Output) Run(ctx context.Context) error {
	var g service.Group
	g.Add("ops", func(context.Context) error { return o.ops.Start() }, o.ops.Stop)
	g.Add("pipelines", func(ctx context.Context) error {
		if err := o.host.Apply(ctx, o.initial); err != nil {
			return fmt.Errorf("start rules: %w", err)
		}
		return nil
	}, func(context.Context) error {
		ctx, cancel := context.WithTimeout(context.Background(), o.cfg.DrainTimeout)
		defer cancel()
		return o.host.Stop(ctx)
	})
	g.Add("api", o.startAPI, o.stopAPI)
	g.AddRun("rules-watcher", o.watch)
	g.Add("ready", func(context.Context) error {
		o.ops.SetReady(true)
		return nil
	}, func(context.Context) error {
		o.ops.SetReady(false)
		return nil
	})
	return g.Run(ctx, o.cfg.StopTimeout, o.logger)
}

func (o *Output) startAPI(context.Context) error {
	ln, err := rpc.Listen(o.cfg.ListenAddr)
	if err != nil {
		return fmt.Errorf("listen api %s: %w", o.cfg.ListenAddr, err)
	}
	mux := http.NewServeMux()
	mux.Handle(o.handler.Mount())
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler:           mux,
		Protocols:         &protos,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(o.logger.Handler(), slog.LevelWarn),
	}
	done := make(chan struct{})
	o.mu.Lock()
	o.srv, o.ln, o.apiDone = srv, ln, done
	o.mu.Unlock()
	go func() {
		defer close(done)
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			o.logger.Error("api server failed", logging.Err(err))
		}
	}()
	o.logger.Info("api listening", "addr", ln.Addr().String())
	return nil
}

// stopAPI closes the listener and ends the Publish streams: they are
// long-lived, so graceful shutdown alone would wait for them until ctx.
func (o *Output) stopAPI(ctx context.Context) error {
	o.mu.Lock()
	srv, done := o.srv, o.apiDone
	o.mu.Unlock()
	if srv == nil {
		return nil
	}
	sctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stop api: %w", ctx.Err())
	}
}

// watch reloads the rules on SIGHUP and when the file changes.
func (o *Output) watch(ctx context.Context) error {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	var tick <-chan time.Time
	if o.cfg.PollInterval > 0 {
		t := time.NewTicker(o.cfg.PollInterval)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-hup:
			o.logger.Info("SIGHUP: reloading rules")
			_ = o.Reload(ctx, true)
		case <-tick:
			_ = o.Reload(ctx, false)
		}
	}
}
