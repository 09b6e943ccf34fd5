// Package pipeline runs the output rules: per rule a bounded buffer, a
// worker, and the plugin processes of its transforms and sink, supervised
// (a crashed or hung plugin is killed and restarted with backoff while its
// records wait in the buffer). [Host] owns the pipelines and swaps rules sets
// without losing buffered records.
//
// Delivery: a record leaves the buffer only once the sink acknowledged it or
// refused it as not retryable, so while the process runs it is delivered at
// least once (a batch in flight when a plugin dies is sent again). A record
// is dropped, and counted, when its buffer is full, when the sink refuses it
// for good, when its rule is deleted and the drain deadline passes, or when
// shutdown's drain deadline passes.
//
// Lock order: Host.mu, then Pipeline.mu, then buffer.mu.
package pipeline

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/keelmq/keel/libs/logging"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/services/output/internal/pluginkit"
	"github.com/keelmq/keel/services/output/internal/rules"
	"github.com/keelmq/keel/services/output/internal/wire"
)

// Config tunes supervision. Zero fields take the defaults below.
type Config struct {
	// BackoffMin and BackoffMax bound the exponential backoff between
	// retries of a batch and between plugin restarts.
	BackoffMin time.Duration
	BackoffMax time.Duration
	// StartTimeout bounds a plugin's launch handshake.
	StartTimeout time.Duration
	// CallTimeout bounds Configure, Transform and Close calls; a plugin that
	// overruns it is treated as hung: killed and restarted. Sink writes use
	// the rule's write_timeout.
	CallTimeout time.Duration
	// DrainTimeout is how long a deleted rule keeps delivering its buffer.
	DrainTimeout time.Duration
}

// Defaults of [Config].
const (
	DefaultBackoffMin   = 100 * time.Millisecond
	DefaultBackoffMax   = 10 * time.Second
	DefaultCallTimeout  = 10 * time.Second
	DefaultDrainTimeout = 30 * time.Second
)

func (c Config) withDefaults() Config {
	if c.BackoffMin <= 0 {
		c.BackoffMin = DefaultBackoffMin
	}
	if c.BackoffMax < c.BackoffMin {
		c.BackoffMax = max(DefaultBackoffMax, c.BackoffMin)
	}
	if c.StartTimeout <= 0 {
		c.StartTimeout = pluginkit.DefaultStartTimeout
	}
	if c.CallTimeout <= 0 {
		c.CallTimeout = DefaultCallTimeout
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	return c
}

// proc is one plugin stage and its current process (nil when down).
type proc struct {
	stage rules.Stage
	kind  string
	p     *pluginkit.Process
	sink  pluginkit.HostSink
	tr    pluginkit.HostTransform
	// maxBatch and inFlight are what a sink asked for in Configure
	// (max_batch_records, max_writes_in_flight).
	maxBatch, inFlight int
	// pidv mirrors p's pid for readers outside the worker.
	pidv atomic.Int64
	// failed is set when the process was killed after a fault, until a
	// relaunch succeeds: that one counts as the restart, however many
	// attempts failed before it.
	failed bool
}

// runtime is the set of plugin processes of one pipeline configuration.
type runtime struct {
	spec       *rules.Pipeline
	transforms []*proc
	sink       *proc
}

func newRuntime(spec *rules.Pipeline) *runtime {
	rt := &runtime{spec: spec, sink: &proc{stage: spec.Sink, kind: pluginkit.KindSink}}
	for _, t := range spec.Transforms {
		rt.transforms = append(rt.transforms, &proc{stage: t, kind: pluginkit.KindTransform})
	}
	return rt
}

func (rt *runtime) procs() []*proc {
	return append(rt.transforms[:len(rt.transforms):len(rt.transforms)], rt.sink)
}

func (rt *runtime) batchSize() int {
	n := rt.spec.MaxBatch
	if rt.sink.maxBatch > 0 && rt.sink.maxBatch < n {
		n = rt.sink.maxBatch
	}
	return max(n, 1)
}

// maxWritesInFlight caps what a sink may ask for: two overlap the next
// batch's encoding, transfer and decoding with a write; more only queue.
const maxWritesInFlight = 4

// writesInFlight is how many sink writes the worker keeps going at once.
func (rt *runtime) writesInFlight() int {
	return max(1, min(rt.sink.inFlight, maxWritesInFlight))
}

// launch starts and configures pr. On error nothing is left running.
func (pr *proc) launch(ctx context.Context, pipeline string, cfg *Config, logger *slog.Logger) error {
	p, err := pluginkit.Launch(pr.stage.Path, pr.kind, cfg.StartTimeout, logger.With("plugin", pr.stage.Plugin))
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, cfg.CallTimeout)
	defer cancel()
	switch pr.kind {
	case pluginkit.KindSink:
		s := p.Sink()
		resp, err := s.Configure(cctx, &pluginv1.SinkServiceConfigureRequest{Pipeline: pipeline, ConfigJson: pr.stage.Config})
		if err != nil {
			p.Kill(true)
			return pr.refused(err)
		}
		pr.sink, pr.maxBatch, pr.inFlight = s, int(resp.GetMaxBatchRecords()), int(resp.GetMaxWritesInFlight())
	default:
		t := p.Transform()
		if _, err := t.Configure(cctx, &pluginv1.TransformServiceConfigureRequest{Pipeline: pipeline, ConfigJson: pr.stage.Config}); err != nil {
			p.Kill(true)
			return pr.refused(err)
		}
		pr.tr = t
	}
	pr.p = p
	pr.pidv.Store(int64(p.Pid()))
	return nil
}

// refused locates err, the plugin's answer to Configure, at the stage's
// config in the rules file.
func (pr *proc) refused(err error) error {
	return &configError{at: pr.stage.ConfigAt.Problem(status.Convert(err).Message())}
}

// kill ends the process after a fault.
func (pr *proc) kill() {
	if pr.p != nil {
		pr.p.Kill(true)
		pr.p, pr.sink, pr.tr = nil, nil, nil
		pr.pidv.Store(0)
		pr.failed = true
	}
}

// start launches every stage; on error it stops those it started.
func (rt *runtime) start(ctx context.Context, cfg *Config, logger *slog.Logger) error {
	for _, pr := range rt.procs() {
		if err := pr.launch(ctx, rt.spec.Name, cfg, logger); err != nil {
			rt.stop(cfg)
			return err
		}
	}
	return nil
}

// stop closes the sink gracefully and ends every process. The stages stop
// side by side: ending a plugin process takes about a second, and a rule
// with several transforms would otherwise spend its whole drain time here.
func (rt *runtime) stop(cfg *Config) {
	var wg sync.WaitGroup
	for _, pr := range rt.procs() {
		if pr.p == nil {
			continue
		}
		wg.Go(func() { pr.stop(cfg) })
	}
	wg.Wait()
}

// stop closes the stage's plugin (gracefully for a sink) and ends it.
func (pr *proc) stop(cfg *Config) {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.CallTimeout)
	defer cancel()
	var closeFn func(context.Context) error
	if pr.sink != nil {
		s := pr.sink
		closeFn = func(ctx context.Context) error {
			_, err := s.Close(ctx, &pluginv1.SinkServiceCloseRequest{})
			return err
		}
	}
	_ = pr.p.Stop(ctx, closeFn)
	pr.p, pr.sink, pr.tr = nil, nil, nil
	pr.pidv.Store(0)
}

// Pipeline is one running rule.
type Pipeline struct {
	name   string
	sinkID string
	cfg    Config
	logger *slog.Logger
	buf    *buffer
	pm     *pipeMetrics

	spec atomic.Pointer[rules.Pipeline]

	mu      sync.Mutex
	pending *runtime // guarded by mu; a started runtime to switch to
	wake    chan struct{}

	state   atomic.Int32 // outputv1.PipelineState
	written atomic.Uint64
	dropped atomic.Uint64
	restart atomic.Uint64

	rt  *runtime                // owned by the worker goroutine
	rtp atomic.Pointer[runtime] // rt, for readers outside the worker
	// seq numbers the writes sent to seqProc, the sink process, and
	// runLast is the last of them in the current run of writes sent
	// behind one another (0: none). Owned by the worker.
	seq, runLast uint64
	seqProc      *pluginkit.Process
	cancel       context.CancelFunc
	done         chan struct{}
	removal      string // drop reason for what is left when the worker ends
}

func newPipeline(spec *rules.Pipeline, rt *runtime, cfg Config, logger *slog.Logger, m *Metrics) *Pipeline {
	p := &Pipeline{
		name: spec.Name, sinkID: spec.Sink.Plugin, cfg: cfg,
		logger: logger.With("rule", spec.Name),
		buf:    newBuffer(spec.BufferRecords, spec.BufferBytes),
		pm:     m.forPipeline(spec.Name, spec.Sink.Plugin),
		wake:   make(chan struct{}, 1), rt: rt, done: make(chan struct{}),
	}
	p.spec.Store(spec)
	p.rtp.Store(rt)
	p.state.Store(int32(outputv1.PipelineState_PIPELINE_STATE_RUNNING))
	p.pm.up.Set(1)
	return p
}

// offer pushes rec without blocking; false means dropped (counted).
func (p *Pipeline) offer(rec wire.Record) bool {
	if p.buf.push(rec) {
		p.pm.in.Inc()
		p.pm.buffered.Inc()
		return true
	}
	p.pm.dropFull.Inc()
	p.dropped.Add(1)
	return false
}

// setRuntime hands a started runtime to the worker, which switches to it
// between batches (or interrupts a retry loop for it).
func (p *Pipeline) setRuntime(rt *runtime) {
	p.mu.Lock()
	old := p.pending
	p.pending = rt
	p.mu.Unlock()
	if old != nil {
		old.stop(&p.cfg)
	}
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *Pipeline) hasPending() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pending != nil
}

func (p *Pipeline) takePending() {
	p.mu.Lock()
	rt := p.pending
	p.pending = nil
	p.mu.Unlock()
	if rt == nil {
		return
	}
	p.rt.stop(&p.cfg)
	p.rt = rt
	p.rtp.Store(rt)
	p.logger.Info("pipeline switched to new plugin configuration")
}

// run is the worker. It returns when ctx ends, or when the buffer was
// closed and is empty.
func (p *Pipeline) run(ctx context.Context) {
	defer close(p.done)
	defer func() {
		p.mu.Lock()
		pend := p.pending
		p.pending = nil
		p.mu.Unlock()
		if pend != nil {
			pend.stop(&p.cfg)
		}
		p.rt.stop(&p.cfg)
		p.pm.up.Set(0)
		if n := p.buf.len(); n > 0 {
			reason := p.removal
			if reason == "" {
				reason = "shutdown"
			}
			p.logger.Warn("pipeline stopped with records undelivered", "records", n, logging.KeyReason, reason)
			if reason == "removed" {
				p.pm.dropRemoved.Add(float64(n))
			} else {
				p.pm.dropShutdown.Add(float64(n))
			}
			p.dropped.Add(uint64(n))
			p.pm.buffered.Sub(float64(n))
		}
	}()
	var flights []*flight // oldest first
	skip := 0             // records the flights hold, from the buffer's head
	defer func() {
		for _, f := range flights {
			f.abandon()
		}
	}()
	for {
		if len(flights) == 0 {
			p.takePending()
		}
		depth := p.rt.writesInFlight()
		if len(flights) < depth && !p.hasPending() {
			var recs wire.Records
			if len(flights) == 0 {
				recs = p.buf.peek(ctx, p.wake, p.rt.batchSize(), pluginkit.MaxBatchBytes)
				if recs == nil {
					if ctx.Err() != nil || p.buf.closedEmpty() {
						return
					}
					continue
				}
			} else {
				recs = p.buf.peekFrom(skip, p.rt.batchSize(), pluginkit.MaxBatchBytes)
			}
			var f *flight
			if recs != nil && depth > 1 {
				f = p.launch(ctx, recs, len(flights) > 0)
			}
			if f != nil {
				flights = append(flights, f)
				skip += len(recs)
				continue
			}
			if recs != nil && len(flights) == 0 {
				// One at a time: the sink takes no more, or the plugins
				// need the retry loop (down, or a transform failing).
				if p.deliver(ctx, recs) {
					p.commit(len(recs))
				}
				continue
			}
		}
		if len(flights) == 0 {
			continue // a new runtime is pending
		}
		f := flights[0]
		var r writeResult
		select {
		case r = <-f.done:
		case <-ctx.Done():
			return
		}
		f.cancel()
		retry, err := p.settle(ctx, f.out, r)
		if err == nil && len(retry) == 0 {
			p.commit(len(f.recs))
			flights, skip = flights[1:], skip-len(f.recs)
			continue
		}
		// The rest of the run goes again after this batch: the sink refuses
		// writes behind a failed one, and a write that went anyway is only
		// sent twice.
		for _, g := range flights[1:] {
			g.abandon()
		}
		flights, skip = flights[:0], 0
		if err != nil {
			retry = f.out
		}
		if p.deliverFrom(ctx, f.recs, retry, true, 1) {
			p.commit(len(f.recs))
		}
	}
}

// commit removes n delivered records from the buffer's head.
func (p *Pipeline) commit(n int) {
	p.buf.commit(n)
	p.pm.buffered.Sub(float64(n))
}

// flight is a sink write in progress.
type flight struct {
	recs   wire.Records // as taken from the buffer
	out    wire.Records // as sent to the sink, after the transforms
	cancel context.CancelFunc
	done   chan writeResult // receives the one result
}

type writeResult struct {
	resp *pluginv1.SinkServiceWriteResponse
	err  error
}

// abandon cancels the write and waits for it to end; its result is not
// looked at, so its records are sent again.
func (f *flight) abandon() {
	f.cancel()
	<-f.done
	f.done <- writeResult{err: context.Canceled} // for a second abandon
}

// launch runs recs through the transforms and starts writing them, behind
// the writes in flight (queued): the sink writes them in order. It returns
// nil when that cannot be done now (a plugin is down or a transform
// failed), leaving it to the retry loop once nothing is in flight.
func (p *Pipeline) launch(ctx context.Context, recs wire.Records, queued bool) *flight {
	pr := p.rt.sink
	if queued {
		// Behind writes to a process that is gone, nothing can go: its
		// successor starts a new run once those have failed.
		if pr.p == nil || pr.p != p.seqProc || pr.p.Exited() {
			return nil
		}
	} else if p.ensure(ctx) != nil {
		return nil
	}
	out, err := p.transform(ctx, recs)
	if err != nil {
		return nil
	}
	if n := len(recs) - len(out); n > 0 {
		p.pm.filtered.Add(float64(n))
	}
	if pr.p != p.seqProc {
		p.seq, p.seqProc = 0, pr.p
	}
	if !queued {
		p.runLast = 0 // nothing ahead of it
	}
	if len(out) == 0 {
		f := &flight{recs: recs, cancel: func() {}, done: make(chan writeResult, 1)}
		f.done <- writeResult{resp: &pluginv1.SinkServiceWriteResponse{}}
		return f
	}
	p.seq++
	// A write waits for the one ahead of it before it goes out.
	f := p.send(ctx, out, p.seq, p.runLast, p.rt.spec.WriteTimeout*time.Duration(p.rt.writesInFlight()))
	p.runLast = p.seq
	f.recs = recs
	return f
}

// deliver runs one batch through the transforms and the sink until the sink
// took every record or refused it for good (true). It returns false when ctx
// ends or a new runtime is pending; the batch then stays in the buffer.
func (p *Pipeline) deliver(ctx context.Context, recs wire.Records) bool {
	return p.deliverFrom(ctx, recs, nil, false, 0)
}

// deliverFrom is deliver from a given point: rem are the records still to
// write when transformed is set, and attempt counts the tries so far.
func (p *Pipeline) deliverFrom(ctx context.Context, recs, rem wire.Records, transformed bool, attempt int) bool {
	if transformed && len(rem) == 0 {
		return true
	}
	delay := p.cfg.BackoffMin
	for i := 1; i < attempt; i++ {
		delay = min(2*delay, p.cfg.BackoffMax)
	}
	for ; ; attempt++ {
		if attempt > 0 {
			p.pm.retries.Inc()
			if !p.sleep(ctx, delay) {
				return false
			}
			delay = min(2*delay, p.cfg.BackoffMax)
		}
		if ctx.Err() != nil || p.hasPending() {
			return false
		}
		if err := p.ensure(ctx); err != nil {
			continue
		}
		if !transformed {
			out, err := p.transform(ctx, recs)
			if err != nil {
				continue
			}
			if n := len(recs) - len(out); n > 0 {
				p.pm.filtered.Add(float64(n))
			}
			rem, transformed = out, true
		}
		if len(rem) == 0 {
			return true
		}
		next, err := p.write(ctx, rem)
		if err != nil {
			continue
		}
		rem = next
		if len(rem) == 0 {
			return true
		}
	}
}

// sleep waits d; false if ctx ended or a new runtime arrived.
func (p *Pipeline) sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-p.wake:
		// Re-arm for peek, then let the caller look at pending.
		select {
		case p.wake <- struct{}{}:
		default:
		}
		return !p.hasPending()
	case <-t.C:
		return true
	}
}

// ensure (re)launches every stage that is down.
func (p *Pipeline) ensure(ctx context.Context) error {
	for _, pr := range p.rt.procs() {
		if pr.p != nil && !pr.p.Exited() {
			continue
		}
		if pr.p != nil { // exited on its own while idle
			p.logger.Warn("plugin exited", "plugin", pr.stage.Plugin, "pid", pr.p.Pid())
			pr.kill()
		}
		p.state.Store(int32(outputv1.PipelineState_PIPELINE_STATE_RESTARTING))
		p.pm.up.Set(0)
		if err := pr.launch(ctx, p.name, &p.cfg, p.logger); err != nil {
			// pr.failed stays set, so that the attempt that succeeds counts
			// the restart.
			p.pm.errLaunch.Inc()
			p.logger.Error("plugin restart failed", "plugin", pr.stage.Plugin, logging.Err(err))
			return err
		}
		if pr.failed {
			p.pm.restart(pr.stage.Plugin)
			p.restart.Add(1)
			p.logger.Info("plugin restarted", "plugin", pr.stage.Plugin, "pid", pr.p.Pid())
			pr.failed = false
		}
	}
	p.state.Store(int32(outputv1.PipelineState_PIPELINE_STATE_RUNNING))
	p.pm.up.Set(1)
	return nil
}

// callFailed handles a failed plugin call: a plugin that exited, broke its
// connection or overran its deadline is killed, to be restarted by ensure.
// An error the plugin itself returned leaves it running.
func (p *Pipeline) callFailed(ctx context.Context, pr *proc, err error) {
	code := status.Code(err)
	exited := pr.p != nil && pr.p.Exited()
	switch {
	case ctx.Err() != nil:
		return
	case exited || code == codes.Unavailable || code == codes.Canceled:
		p.logger.Warn("plugin crashed, restarting", "plugin", pr.stage.Plugin, "pid", pid(pr), logging.Err(err))
		pr.kill()
	case code == codes.DeadlineExceeded || errors.Is(err, context.DeadlineExceeded):
		p.logger.Warn("plugin call timed out, killing the hung plugin", "plugin", pr.stage.Plugin, "pid", pid(pr), logging.Err(err))
		pr.kill()
	default:
		p.logger.Warn("plugin call failed", "plugin", pr.stage.Plugin, logging.Err(err))
	}
}

func pid(pr *proc) int {
	if pr.p == nil {
		return 0
	}
	return pr.p.Pid()
}

func (p *Pipeline) transform(ctx context.Context, recs wire.Records) (wire.Records, error) {
	for _, pr := range p.rt.transforms {
		cctx, cancel := context.WithTimeout(ctx, p.cfg.CallTimeout)
		out, err := pr.tr.TransformRecords(cctx, recs)
		cancel()
		if err != nil {
			p.pm.errTransform.Inc()
			p.callFailed(ctx, pr, err)
			return nil, err
		}
		recs = out
		if len(recs) == 0 {
			break
		}
	}
	return recs, nil
}

// write sends recs to the sink and returns the records to retry.
func (p *Pipeline) write(ctx context.Context, recs wire.Records) (wire.Records, error) {
	f := p.send(ctx, recs, 0, 0, p.rt.spec.WriteTimeout)
	r := <-f.done
	f.cancel()
	return p.settle(ctx, recs, r)
}

// send starts writing recs to the sink under sequence seq, behind the
// write with sequence follows.
func (p *Pipeline) send(ctx context.Context, recs wire.Records, seq, follows uint64, timeout time.Duration) *flight {
	sink := p.rt.sink.sink
	cctx, cancel := context.WithTimeout(ctx, timeout)
	f := &flight{out: recs, cancel: cancel, done: make(chan writeResult, 1)}
	go func() {
		// A sampled batch gets a span (the sampling ratio applies per batch).
		cctx, span := tracer.StartRoot(cctx, "output.sink.write", trace.SpanKindClient, "")
		start := time.Now()
		resp, err := sink.WriteRecords(cctx, recs, seq, follows)
		p.pm.writeTime.Observe(time.Since(start).Seconds())
		if span != nil {
			span.SetAttributes(attrPipeline.String(p.name), attrSink.String(p.sinkID), attrRecords.Int(len(recs)),
				attrFailures.Int(len(resp.GetFailures())))
			if err != nil {
				span.RecordError(err)
				span.SetStatus(otelcodes.Error, err.Error())
			}
			span.End()
		}
		f.done <- writeResult{resp: resp, err: err}
	}()
	return f
}

// settle takes the result of a write of recs, and returns the records to
// retry.
func (p *Pipeline) settle(ctx context.Context, recs wire.Records, r writeResult) (wire.Records, error) {
	pr := p.rt.sink
	resp, err := r.resp, r.err
	if err != nil {
		p.pm.errSink.Inc()
		p.callFailed(ctx, pr, err)
		return nil, err
	}
	now := time.Now().UnixNano()
	fails := resp.GetFailures()
	if len(fails) == 0 {
		p.acked(recs, now)
		return nil, nil
	}
	p.pm.errSink.Inc()
	failed := make(map[uint32]*pluginv1.RecordFailure, len(fails))
	for _, f := range fails {
		failed[f.GetIndex()] = f
	}
	var retry wire.Records
	var rejected int
	// A batch can fail for several reasons (one record refused, others
	// to retry): each log line names one of its own.
	var rejectReason, retryReason string
	for i, r := range recs {
		f, bad := failed[uint32(i)]
		switch {
		case !bad:
			p.acked(recs[i:i+1], now)
		case f.GetRetryable():
			retry = append(retry, r)
			if retryReason == "" {
				retryReason = f.GetMessage()
			}
		default:
			rejected++
			if rejectReason == "" {
				rejectReason = f.GetMessage()
			}
		}
	}
	if rejected > 0 {
		p.pm.dropRejected.Add(float64(rejected))
		p.dropped.Add(uint64(rejected))
		p.logger.Warn("sink rejected records", "records", rejected, logging.KeyReason, rejectReason)
	}
	if len(retry) > 0 {
		p.logger.Debug("sink write partly failed, retrying", "records", len(retry), logging.KeyReason, retryReason)
	}
	return retry, nil
}

func (p *Pipeline) acked(recs wire.Records, now int64) {
	p.pm.out.Add(float64(len(recs)))
	p.written.Add(uint64(len(recs)))
	for _, r := range recs {
		if t := r.Ingress; t > 0 && now >= t {
			p.pm.latency.Observe(float64(now-t) / 1e9)
		}
	}
}

// status describes the pipeline.
func (p *Pipeline) status() *outputv1.PipelineStatus {
	spec := p.spec.Load()
	st := &outputv1.PipelineStatus{
		Name: p.name, State: outputv1.PipelineState(p.state.Load()), Sink: spec.Sink.Plugin,
		BufferedRecords: uint64(p.buf.len()), BufferCapacity: uint64(p.buf.capacity()),
		WrittenRecords: p.written.Load(), DroppedRecords: p.dropped.Load(), PluginRestarts: p.restart.Load(),
	}
	for _, t := range spec.Transforms {
		st.Transforms = append(st.Transforms, t.Plugin)
	}
	return st
}

// pids returns the process IDs of the running plugins, transforms first
// then the sink (0 for a stage that is down). For tests and operators.
func (p *Pipeline) pids() []int {
	var out []int
	for _, pr := range p.rtp.Load().procs() {
		out = append(out, int(pr.pidv.Load()))
	}
	return out
}
