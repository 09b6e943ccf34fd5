package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/keelmq/keel/libs/logging"
)

// NewRegistry returns a Prometheus registry holding the Go runtime and
// process collectors. Each service registers its own keel_<svc>_* metrics on
// it and passes it to [NewOps].
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return reg
}

// Ops is the operations HTTP server of a service. It serves:
//
//   - /metrics: the registry given to [NewOps], if any;
//   - /healthz: 200 "ok" for as long as the process serves HTTP;
//   - /readyz: 200 "ok" once [Ops.SetReady] (true) was called and every
//     check added with [Ops.AddReadyCheck] passes; otherwise 503 with one
//     line per failing check, naming it;
//   - /debug/pprof/: net/http/pprof, if EnablePprof is set before [Ops.Start];
//   - anything added with [Ops.Handle].
//
// Configure it, then call [Ops.Start]; [Ops.Stop] shuts it down.
type Ops struct {
	// EnablePprof mounts net/http/pprof under /debug/pprof/. It must be set
	// before Start (or Handler) is first called. Profiles expose internals,
	// so keep the ops address off public networks.
	EnablePprof bool

	addr   string
	logger *slog.Logger
	mux    *http.ServeMux
	ready  atomic.Bool

	checksMu sync.Mutex
	checks   []readyCheck // guarded by checksMu

	pprofOnce sync.Once

	mu      sync.Mutex
	started bool          // guarded by mu
	srv     *http.Server  // guarded by mu; nil until started with an address
	ln      net.Listener  // guarded by mu
	done    chan struct{} // closed when the serve goroutine returns

	stopOnce sync.Once
	stopErr  error // set inside stopOnce
}

type readyCheck struct {
	name string
	fn   func() error
}

// NewOps returns an ops server for addr ("host:port"; ":0" picks a free port,
// "" disables the server). If reg is nil, /metrics is not served. A nil
// logger discards. NewOps starts nothing.
func NewOps(addr string, reg *prometheus.Registry, logger *slog.Logger) *Ops {
	if logger == nil {
		logger = logging.Discard()
	}
	o := &Ops{
		addr:   addr,
		logger: logger.With(logging.KeyComponent, "ops"),
		mux:    http.NewServeMux(),
	}
	if reg != nil {
		o.mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
			ErrorLog:      promLogger{o.logger},
			ErrorHandling: promhttp.ContinueOnError,
		}))
	}
	o.mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeText(w, http.StatusOK, "ok\n")
	})
	o.mux.HandleFunc("/readyz", o.serveReadyz)
	return o
}

// AddReadyCheck adds a readiness check, run on every /readyz request; it
// fails readiness by returning an error. fn must be safe for concurrent use
// and should return quickly.
func (o *Ops) AddReadyCheck(name string, fn func() error) {
	o.checksMu.Lock()
	defer o.checksMu.Unlock()
	o.checks = append(o.checks, readyCheck{name: name, fn: fn})
}

// SetReady marks the service ready or not. /readyz fails until it is called
// with true; set it to false at the start of shutdown so that load balancers
// drain the instance.
func (o *Ops) SetReady(ready bool) {
	if o.ready.Swap(ready) != ready {
		o.logger.Info("readiness changed", "ready", ready)
	}
}

// Ready reports the value last given to [Ops.SetReady].
func (o *Ops) Ready() bool { return o.ready.Load() }

// Handle registers h for pattern, as [http.ServeMux.Handle] does. It may be
// called before or after Start.
func (o *Ops) Handle(pattern string, h http.Handler) {
	o.mux.Handle(pattern, h)
}

// Handler returns the handler serving every ops endpoint, for tests that
// drive it without a listener.
func (o *Ops) Handler() http.Handler {
	o.mountPprof()
	return o.mux
}

// Start binds the address given to [NewOps] and serves in a goroutine owned
// by o, which [Ops.Stop] waits for. With an empty address it does nothing.
// It returns [ErrAlreadyStarted] if called twice.
func (o *Ops) Start() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.started {
		return fmt.Errorf("ops server: %w", ErrAlreadyStarted)
	}
	o.started = true
	if o.addr == "" {
		o.logger.Info("ops server disabled")
		return nil
	}
	o.mountPprof()

	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return fmt.Errorf("listen ops %s: %w", o.addr, err)
	}
	o.ln = ln
	o.srv = &http.Server{
		Handler:           o.mux,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       time.Minute,
		ErrorLog:          slog.NewLogLogger(o.logger.Handler(), slog.LevelWarn),
	}
	o.done = make(chan struct{})
	srv, done := o.srv, o.done
	go func() {
		defer close(done)
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			o.logger.Error("ops server failed", logging.Err(err))
		}
	}()
	o.logger.Info("ops server listening", "addr", ln.Addr().String(), "pprof", o.EnablePprof)
	return nil
}

// Addr returns the address the server is bound to, with the port chosen for
// ":0", or "" before Start or when disabled.
func (o *Ops) Addr() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ln == nil {
		return ""
	}
	return o.ln.Addr().String()
}

// Stop shuts the server down gracefully, closing it hard if ctx ends first,
// and waits for its goroutine. It is safe to call more than once, and
// before or without Start; later calls return the first call's result.
func (o *Ops) Stop(ctx context.Context) error {
	o.mu.Lock()
	srv, done := o.srv, o.done
	o.mu.Unlock()
	if srv == nil {
		return nil
	}
	o.stopOnce.Do(func() {
		if err := srv.Shutdown(ctx); err != nil {
			_ = srv.Close()
			o.stopErr = fmt.Errorf("shut down ops server: %w", err)
		}
		<-done
		o.logger.Info("ops server stopped")
	})
	return o.stopErr
}

func (o *Ops) mountPprof() {
	o.pprofOnce.Do(func() {
		if !o.EnablePprof {
			return
		}
		o.mux.HandleFunc("/debug/pprof/", pprof.Index)
		o.mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		o.mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		o.mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		o.mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	})
}

func (o *Ops) serveReadyz(w http.ResponseWriter, _ *http.Request) {
	o.checksMu.Lock()
	checks := o.checks[:len(o.checks):len(o.checks)]
	o.checksMu.Unlock()

	var failed strings.Builder
	if !o.ready.Load() {
		failed.WriteString("ready: service not marked ready\n")
	}
	for _, c := range checks {
		if err := c.fn(); err != nil {
			fmt.Fprintf(&failed, "%s: %v\n", c.name, err)
		}
	}
	if failed.Len() > 0 {
		writeText(w, http.StatusServiceUnavailable, failed.String())
		return
	}
	writeText(w, http.StatusOK, "ok\n")
}

func writeText(w http.ResponseWriter, code int, body string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(body))
}

// promLogger adapts a slog.Logger to promhttp.Logger.
type promLogger struct{ logger *slog.Logger }

func (l promLogger) Println(v ...any) {
	l.logger.Error("serve metrics failed", logging.KeyError, fmt.Sprint(v...))
}
