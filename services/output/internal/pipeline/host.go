package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/keelmq/keel/libs/logging"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/services/output/internal/rules"
	"github.com/keelmq/keel/services/output/internal/wire"
)

// snapshot is an immutable view of the running rules, read on every offer.
type snapshot struct {
	set   *rules.Set
	pipes map[string]*Pipeline
}

// Filters is one published set of the running rules' topic filters, in the
// form edges receive them. Edges send only what these filters match, so a
// set must match exactly what the rules match, no less.
type Filters struct {
	// Proto is shared by every Publish stream and must not be modified.
	Proto *outputv1.RuleFilters
	// Changed is closed once a newer set replaces this one.
	Changed <-chan struct{}

	changed  chan struct{}
	byTenant map[string][]string
}

func newFilters(version uint64, byTenant map[string][]string) *Filters {
	pf := &outputv1.RuleFilters{Version: version, Tenants: make([]*outputv1.TenantFilters, 0, len(byTenant))}
	for _, t := range slices.Sorted(maps.Keys(byTenant)) {
		pf.Tenants = append(pf.Tenants, &outputv1.TenantFilters{Tenant: t, Filters: byTenant[t]})
	}
	ch := make(chan struct{})
	return &Filters{Proto: pf, Changed: ch, changed: ch, byTenant: byTenant}
}

// Host owns the pipelines of one output instance.
type Host struct {
	cfg     Config
	logger  *slog.Logger
	metrics *Metrics

	mu      sync.Mutex // serialises Apply and Stop
	stopped bool       // guarded by mu
	snap    atomic.Pointer[snapshot]
	filters atomic.Pointer[Filters] // replaced under mu
	wg      sync.WaitGroup          // workers and drains
}

// NewHost returns a host with no rules. m may be nil (unregistered metrics).
func NewHost(cfg Config, logger *slog.Logger, m *Metrics) *Host {
	if logger == nil {
		logger = logging.Discard()
	}
	if m == nil {
		m = NewMetrics(nil)
	}
	h := &Host{cfg: cfg.withDefaults(), logger: logger, metrics: m}
	h.snap.Store(&snapshot{set: &rules.Set{}, pipes: map[string]*Pipeline{}})
	h.filters.Store(newFilters(1, map[string][]string{}))
	return h
}

// Filters returns the topic filters of the running rules.
func (h *Host) Filters() *Filters { return h.filters.Load() }

// publishFilters replaces the published filters when set matches other
// messages than they do. Called with mu held, after set took effect, so that
// an edge never leaves out a message the rules now match for longer than
// the new set takes to reach it.
func (h *Host) publishFilters(set *rules.Set) {
	cur := h.filters.Load()
	next := set.Filters()
	if maps.EqualFunc(cur.byTenant, next, slices.Equal) {
		return
	}
	h.filters.Store(newFilters(cur.Proto.GetVersion()+1, next))
	close(cur.changed)
}

// Apply switches to set. Pipelines whose plugins and plugin configuration
// are unchanged keep running untouched. For new or changed ones the plugins
// are launched and configured first; if any of them fails, every process
// launched here is killed, the error is returned (a config a plugin refused
// is reported at its line in the rules file, as rules.Parse reports
// problems) and the running rules stay as they were. Otherwise changed
// pipelines switch between batches, keeping their buffers; deleted ones stop
// taking records and drain for DrainTimeout.
func (h *Host) Apply(ctx context.Context, set *rules.Set) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopped {
		return ErrStopped
	}
	old := h.snap.Load()
	type change struct {
		spec *rules.Pipeline
		rt   *runtime
		pipe *Pipeline // nil for a new pipeline
	}
	var changes []change
	var errs []error
	for _, spec := range set.Pipelines {
		cur := old.pipes[spec.Name]
		if cur != nil && cur.spec.Load().SameRuntime(spec) {
			changes = append(changes, change{spec: spec, pipe: cur})
			continue
		}
		rt := newRuntime(spec)
		if err := rt.start(ctx, &h.cfg, h.logger.With("rule", spec.Name)); err != nil {
			var located *rules.Error
			if !errors.As(err, &located) {
				err = fmt.Errorf("rule %s: %w", spec.Name, err)
			}
			errs = append(errs, err)
			continue
		}
		changes = append(changes, change{spec: spec, rt: rt, pipe: cur})
	}
	if len(errs) > 0 {
		for _, c := range changes {
			if c.rt != nil {
				c.rt.stop(&h.cfg)
			}
		}
		h.metrics.Reloads.WithLabelValues("error").Inc()
		return errors.Join(errs...)
	}

	next := &snapshot{set: set, pipes: make(map[string]*Pipeline, len(set.Pipelines))}
	for _, c := range changes {
		switch {
		case c.pipe == nil:
			p := newPipeline(c.spec, c.rt, h.cfg, h.logger, h.metrics)
			ctx, cancel := context.WithCancel(context.Background())
			p.cancel = cancel
			h.wg.Go(func() { p.run(ctx) })
			next.pipes[c.spec.Name] = p
			h.logger.Info("rule started", "rule", c.spec.Name, "sink", c.spec.Sink.Plugin)
		default:
			c.pipe.spec.Store(c.spec)
			c.pipe.buf.setLimits(c.spec.BufferRecords, c.spec.BufferBytes)
			if c.rt != nil {
				c.pipe.setRuntime(c.rt)
				h.logger.Info("rule changed: switching plugins, keeping its buffer", "rule", c.spec.Name)
			}
			next.pipes[c.spec.Name] = c.pipe
		}
	}
	h.snap.Store(next)
	h.publishFilters(set)
	for name, p := range old.pipes {
		if _, ok := next.pipes[name]; !ok {
			h.logger.Info("rule deleted: draining its buffer", "rule", name, "records", p.buf.len())
			h.drain(p, "removed")
		}
	}
	h.metrics.Reloads.WithLabelValues("ok").Inc()
	return nil
}

// NoteReloadFailure counts a rules reload that failed before Apply (a file
// that does not parse).
func (h *Host) NoteReloadFailure() { h.metrics.Reloads.WithLabelValues("error").Inc() }

// drain closes p's buffer and lets its worker deliver what is left for
// DrainTimeout before it is cancelled.
func (h *Host) drain(p *Pipeline, reason string) {
	p.removal = reason
	p.buf.close()
	h.wg.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), h.cfg.DrainTimeout)
		defer cancel()
		select {
		case <-p.done:
		case <-ctx.Done():
			p.cancel()
			<-p.done
		}
		p.cancel()
	})
}

// Offer routes rec, whose message is msg, to the pipelines named in names
// or, when names is empty, to those whose rules match its tenant and topic.
// It never blocks. It returns how many pipelines matched and how many
// refused the record (buffer full or unknown name), which are counted as
// drops.
func (h *Host) Offer(rec wire.Record, msg wire.Message, names []string) (matched, refused int) {
	snap := h.snap.Load()
	if len(names) > 0 {
		for _, n := range names {
			matched++
			p := snap.pipes[n]
			if p == nil || !p.offer(rec) {
				refused++
			}
		}
		return matched, refused
	}
	snap.set.Match(msg.Tenant, msg.Topic, func(spec *rules.Pipeline) {
		matched++
		if p := snap.pipes[spec.Name]; p == nil || !p.offer(rec) {
			refused++
		}
	})
	if matched == 0 {
		h.metrics.Unmatched.Inc()
	}
	return matched, refused
}

// Invalid counts a record refused on receipt for reason.
func (h *Host) Invalid(reason string) { h.metrics.Invalid.WithLabelValues(reason).Inc() }

// Status describes every pipeline, sorted by name.
func (h *Host) Status() []*outputv1.PipelineStatus {
	snap := h.snap.Load()
	out := make([]*outputv1.PipelineStatus, 0, len(snap.set.Pipelines))
	for _, spec := range snap.set.Pipelines {
		if p := snap.pipes[spec.Name]; p != nil {
			out = append(out, p.status())
		}
	}
	return out
}

// Buffered returns the records waiting in every pipeline.
func (h *Host) Buffered() int {
	n := 0
	for _, p := range h.snap.Load().pipes {
		n += p.buf.len()
	}
	return n
}

// PluginPIDs returns the plugin process IDs of a pipeline, transforms first
// and then the sink (0 for a stage that is down), or nil for an unknown
// pipeline.
func (h *Host) PluginPIDs(name string) []int {
	p := h.snap.Load().pipes[name]
	if p == nil {
		return nil
	}
	return p.pids()
}

// Stop stops taking records, lets every pipeline deliver its buffer until
// ctx ends, then stops the workers and their plugins. What is still buffered
// then is dropped and counted (reason shutdown). Safe to call more than once.
func (h *Host) Stop(ctx context.Context) error {
	h.mu.Lock()
	if !h.stopped {
		h.stopped = true
		snap := h.snap.Load()
		h.snap.Store(&snapshot{set: &rules.Set{}, pipes: map[string]*Pipeline{}})
		for _, p := range snap.pipes {
			p.removal = "shutdown"
			p.buf.close()
			h.wg.Go(func() {
				select {
				case <-p.done:
				case <-ctx.Done():
				}
				p.cancel()
				<-p.done
			})
		}
	}
	h.mu.Unlock()
	done := make(chan struct{})
	go func() { h.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("stop output host: %w", ctx.Err())
	}
}
