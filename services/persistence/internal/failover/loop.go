package failover

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keelmq/keel/services/persistence/internal/metrics"
)

// Default loop settings.
const (
	DefaultCheckInterval     = 250 * time.Millisecond
	DefaultDownAfter         = 3 * time.Second
	DefaultPromotionLeaseTTL = 10 * time.Second
	DefaultReconcileInterval = 5 * time.Second
)

// LoopConfig configures the failover loop.
type LoopConfig struct {
	// CheckInterval is how often the record is read and the primary pinged.
	CheckInterval time.Duration `yaml:"check_interval"`
	// DownAfter is how long the recorded primary must stay unanswering
	// before a promotion starts.
	DownAfter time.Duration `yaml:"down_after"`
	// PromotionLeaseTTL is the promotion lease asked of the coordinator; it
	// bounds one promotion.
	PromotionLeaseTTL time.Duration `yaml:"promotion_lease_ttl"`
	// ReconcileInterval is how often the lease holder demotes stray
	// primaries and re-points replicas.
	ReconcileInterval time.Duration `yaml:"reconcile_interval"`
	// FenceWriters makes a failover take its lease with fence_writers (the
	// coordinator then grants the group's other writers no writes) and
	// wait, before it promotes, until each of them reported its writes
	// paused or its lease lapsed, at most one member lease TTL
	// (Promoter.WaitWriters), so that no writer cut off with the old
	// primary still acknowledges through it. On by default; off, such a
	// writer's acknowledgements until its lease lapses are lost with the
	// old primary.
	FenceWriters bool `yaml:"fence_writers"`
}

// RegisterFlags registers the settings under prefix.
func (c *LoopConfig) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.DurationVar(&c.CheckInterval, prefix+"check-interval", DefaultCheckInterval, "how often to read the group record and ping its primary")
	fs.DurationVar(&c.DownAfter, prefix+"down-after", DefaultDownAfter, "how long the primary must stay unanswering before a replica is promoted")
	fs.DurationVar(&c.PromotionLeaseTTL, prefix+"promotion-lease-ttl", DefaultPromotionLeaseTTL, "promotion lease asked of the coordinator (bounds one promotion)")
	fs.DurationVar(&c.ReconcileInterval, prefix+"reconcile-interval", DefaultReconcileInterval, "how often to demote stray primaries and re-point replicas")
	fs.BoolVar(&c.FenceWriters, prefix+"fence-writers", true, "before promoting, stop the group's other writers and wait until each has paused or its lease lapsed (at most one member lease TTL), so that none cut off with the old primary still acknowledges through it")
}

// Validate checks the settings.
func (c *LoopConfig) Validate() error {
	if c.CheckInterval <= 0 || c.DownAfter <= 0 || c.PromotionLeaseTTL <= 0 || c.ReconcileInterval <= 0 {
		return errors.New("failover intervals must be positive")
	}
	if c.PromotionLeaseTTL > 60*time.Second {
		return errors.New("failover.promotion-lease-ttl is at most 60s (the coordinator's cap)")
	}
	return nil
}

// Leases is what the loop needs of the coordinator beyond [Records].
type Leases interface {
	Records
	// AcquirePromotionLease takes or renews the group's promotion lease
	// for a reconcile or a switchover.
	AcquirePromotionLease(ctx context.Context, ttl time.Duration) (bool, error)
	// FailoverLease takes a failover's lease, during which the coordinator
	// grants the group's other writers no writes, or renews it (renew is
	// its epoch).
	FailoverLease(ctx context.Context, ttl time.Duration, renew uint64) (FailoverLease, error)
}

// Loop follows a group's record and fails the group over: every instance
// runs one. Each tick it reads the record and re-points its [Follower];
// when the recorded primary has not answered for DownAfter, the instance
// that gets the promotion lease runs the [Promoter]; periodically the lease
// holder reconciles the group (demotes a returned old primary).
type Loop struct {
	cfg      LoopConfig
	records  Leases
	follower *Follower
	promoter *Promoter
	metrics  *metrics.Metrics
	logger   *slog.Logger

	mu      sync.Mutex
	pingers map[string]*redis.Client

	// primaryDown is set while the recorded primary does not answer.
	primaryDown atomic.Bool
	// failoverEpoch is the epoch of the failover lease held, 0 when none.
	failoverEpoch atomic.Uint64
	// failingOver is set while this instance runs a failover, and
	// published is the epoch of the last record one of its failovers
	// published: Gate.
	failingOver atomic.Bool
	published   atomic.Uint64

	// promoting (a one-slot semaphore) is held by a failover, reconcile or
	// switchover of this instance: the promotion lease is per member, so it
	// alone keeps them from running together here (a renewal by one would
	// also cut the lease of the other short).
	promoting chan struct{}
}

// promotionWait bounds how long a switchover waits for a reconcile or
// failover of this instance to end.
const promotionWait = 5 * time.Second

func (l *Loop) tryPromoting() bool {
	select {
	case l.promoting <- struct{}{}:
		return true
	default:
		return false
	}
}

func (l *Loop) donePromoting() { <-l.promoting }

// NewLoop returns a loop; m may be nil.
func NewLoop(cfg LoopConfig, records Leases, f *Follower, p *Promoter, m *metrics.Metrics, logger *slog.Logger) *Loop {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Loop{cfg: cfg, records: records, follower: f, promoter: p, metrics: m, logger: logger, pingers: map[string]*redis.Client{},
		promoting: make(chan struct{}, 1)}
}

// Run runs until ctx ends.
func (l *Loop) Run(ctx context.Context) error {
	defer l.closePingers()
	tk := time.NewTicker(l.cfg.CheckInterval)
	defer tk.Stop()
	var downSince, lastReconcile time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tk.C:
		}
		rec, err := l.get(ctx)
		if err != nil {
			l.logger.Debug("reading group record failed", "error", err)
			continue
		}
		l.follow(rec)
		if l.ping(ctx, rec.Primary) == nil {
			downSince = time.Time{}
			l.primaryDown.Store(false)
			l.gauge(1)
			if time.Since(lastReconcile) >= l.cfg.ReconcileInterval {
				lastReconcile = time.Now()
				l.reconcile(ctx)
			}
			continue
		}
		l.gauge(0)
		l.primaryDown.Store(true)
		if downSince.IsZero() {
			downSince = time.Now()
			l.logger.Warn("redis primary not answering", "primary", rec.Primary, "record_epoch", rec.Epoch)
			continue
		}
		if time.Since(downSince) < l.cfg.DownAfter {
			continue
		}
		if l.failover(ctx, rec) {
			downSince = time.Time{}
		}
	}
}

// ErrFailingOver is why an instance refuses writes while it fails its
// group over.
var ErrFailingOver = errors.New("failing the redis group over: not acknowledging writes")

// Gate refuses writes (ErrFailingOver) while this instance runs a failover,
// and after one until it follows the record it published. The coordinator
// grants the group's other writers no writes meanwhile, but not the lease
// holder: were its writes acknowledged, one written through the old
// primary after the replicas' positions were read, and confirmed (WAIT) by
// the replica that is not promoted, would be lost. The instance's server
// asks it before a batch is written and again before it is answered.
func (l *Loop) Gate() error {
	if l.failingOver.Load() {
		return ErrFailingOver
	}
	if p := l.published.Load(); p != 0 && l.follower.Record().Epoch < p {
		// Following the record failed: the old primary may still take
		// the writes, under the old record.
		return ErrFailingOver
	}
	return nil
}

// PrimaryDown reports whether the recorded primary did not answer this
// instance's last ping: a failover may be under way.
func (l *Loop) PrimaryDown() bool { return l.primaryDown.Load() }

func (l *Loop) get(ctx context.Context) (Record, error) {
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return l.records.Get(cctx)
}

func (l *Loop) follow(rec Record) {
	changed, err := l.follower.Follow(rec)
	if err != nil {
		l.logger.Error("following group record failed", "primary", rec.Primary, "error", err)
		return
	}
	if changed {
		l.logger.Info("following group record", "primary", rec.Primary, "record_epoch", rec.Epoch)
		if l.metrics != nil {
			l.metrics.RecordChanges.Inc()
			l.metrics.GroupEpoch.Set(float64(rec.Epoch))
		}
	}
}

func (l *Loop) gauge(v float64) {
	if l.metrics != nil {
		l.metrics.PrimaryUp.Set(v)
	}
}

// failover runs a promotion if this instance gets the lease; it reports
// whether the group has a new record.
func (l *Loop) failover(ctx context.Context, rec Record) bool {
	if !l.tryPromoting() {
		return false
	}
	defer l.donePromoting()
	ttl := l.cfg.PromotionLeaseTTL
	actx, cancel := context.WithTimeout(ctx, ttl)
	var ok bool
	var err error
	var lease FailoverLease
	if l.cfg.FenceWriters {
		lease, err = l.records.FailoverLease(actx, ttl, 0)
		ok = lease.Acquired
	} else {
		ok, err = l.records.AcquirePromotionLease(actx, ttl)
	}
	cancel()
	if err != nil || !ok {
		l.logger.Debug("promotion lease not held", "error", err)
		return false
	}
	// Paused from before the positions are read until the new record is
	// followed, or the failover given up and the old primary kept (Gate).
	l.failingOver.Store(true)
	defer l.failingOver.Store(false)
	bound := ttl
	if l.cfg.FenceWriters {
		// The promoter first waits for the old writers to pause
		// (WaitWriters), which can outlast one promotion lease: it is kept
		// meanwhile.
		l.failoverEpoch.Store(lease.Epoch)
		defer l.failoverEpoch.Store(0)
		defer l.keepLease(ctx, ttl, lease.Epoch, "failover")()
		bound += maxWritersWait
	}
	cctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	start := time.Now()
	next, err := l.promoter.Failover(cctx)
	if err != nil {
		l.logger.Error("redis failover failed; retrying", "primary", rec.Primary, "error", err)
		return false
	}
	l.logger.Warn("redis failover done", "old_primary", rec.Primary, "primary", next.Primary, "record_epoch", next.Epoch, "took", time.Since(start))
	if l.metrics != nil {
		l.metrics.Failovers.Inc()
	}
	l.published.Store(next.Epoch)
	l.follow(next)
	return true
}

// reconcile demotes stray primaries, holding the promotion lease briefly so
// it never races a promotion in progress elsewhere. It takes the lease only
// when a node needs it: held at every reconcile, the lease would rarely be
// free for a switchover asked of another instance.
func (l *Loop) reconcile(ctx context.Context) {
	if !l.tryPromoting() {
		return
	}
	defer l.donePromoting()
	cctx, cancel := context.WithTimeout(ctx, l.reconcileLeaseTTL())
	defer cancel()
	if need, err := l.promoter.NeedsReconcile(cctx); err != nil || !need {
		return
	}
	ok, err := l.records.AcquirePromotionLease(cctx, l.reconcileLeaseTTL())
	if err != nil || !ok {
		return
	}
	if err := l.promoter.Reconcile(cctx); err != nil {
		l.logger.Warn("reconciling redis group failed", "error", err)
	}
}

// Describe reads every node of the record this instance follows.
func (l *Loop) Describe(ctx context.Context) (Record, []NodeStatus) {
	rec := l.follower.Record()
	return rec, l.promoter.Describe(ctx, rec)
}

// Switchover runs a [Promoter.Switchover] under the group's promotion
// lease, renewed while it runs, and follows the new record. It waits a
// moment for a failover, reconcile or switchover of this instance to end
// ([ErrPromotionRunning] after 5 s) and for another member to let the lease
// go ([ErrLeaseHeld] after PromotionLeaseTTL plus a reconcile's lease).
func (l *Loop) Switchover(ctx context.Context, opts SwitchoverOptions) (SwitchoverResult, error) {
	start := time.Now()
	res, err := l.switchover(ctx, opts)
	result := SwitchoverOutcome(err)
	if l.metrics != nil {
		l.metrics.Switchovers.WithLabelValues(result).Inc()
		if res.PausedFor > 0 {
			l.metrics.SwitchoverPause.Observe(res.PausedFor.Seconds())
		}
	}
	if err != nil {
		l.logger.Error("redis switchover failed", "to", opts.To, "result", result, "error", err, "paused_for", res.PausedFor, "took", time.Since(start))
		return res, err
	}
	l.logger.Warn("redis switchover done", "old_primary", res.Old.Primary, "primary", res.New.Primary, "old_record_epoch", res.Old.Epoch,
		"record_epoch", res.New.Epoch, "offset", res.Offset, "paused_for", res.PausedFor, "old_primary_demoted", res.Demoted, "took", time.Since(start))
	return res, nil
}

func (l *Loop) switchover(ctx context.Context, opts SwitchoverOptions) (SwitchoverResult, error) {
	// A reconcile takes a moment; a failover here means the primary is down.
	wait := time.NewTimer(promotionWait)
	defer wait.Stop()
	select {
	case l.promoting <- struct{}{}:
	case <-wait.C:
		return SwitchoverResult{}, ErrPromotionRunning
	case <-ctx.Done():
		return SwitchoverResult{}, ctx.Err()
	}
	defer l.donePromoting()
	// Refuse a bad target at once, before waiting for the lease.
	if _, err := l.promoter.CheckSwitchover(ctx, opts); err != nil {
		return SwitchoverResult{}, err
	}
	ttl := l.cfg.PromotionLeaseTTL
	if err := l.acquireForSwitchover(ctx, ttl); err != nil {
		return SwitchoverResult{}, err
	}
	// Keep the lease while the switchover runs; if it lapses anyway, the
	// record's compare-and-set fails and the switchover is undone.
	defer l.keepLease(ctx, ttl, 0, "switchover")()
	res, err := l.promoter.Switchover(ctx, opts)
	if err != nil {
		return res, err
	}
	l.follow(res.New)
	return res, nil
}

// maxWritersWait bounds a failover's wait for the old writers' leases
// (Promoter.WaitWriters), beyond the promotion lease's own TTL.
const maxWritersWait = time.Minute

// keepLease renews the promotion lease every ttl/3 until the returned stop
// is called; what for names the work in logs. If it lapses anyway, the
// record's compare-and-set fails and the work is undone or retried.
// FailoverLeaseEpoch is the epoch of the failover lease this instance
// holds, 0 when it runs no failover.
func (l *Loop) FailoverLeaseEpoch() uint64 { return l.failoverEpoch.Load() }

// keepLease renews the promotion lease every ttl/3 until stopped: a
// failover's of epoch failover, or a switchover's when failover is 0.
func (l *Loop) keepLease(ctx context.Context, ttl time.Duration, failover uint64, what string) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tk := time.NewTicker(ttl / 3)
		defer tk.Stop()
		for {
			select {
			case <-done:
				return
			case <-tk.C:
			}
			cctx, cancel := context.WithTimeout(ctx, ttl/3)
			var ok bool
			var err error
			if failover != 0 {
				var lease FailoverLease
				lease, err = l.records.FailoverLease(cctx, ttl, failover)
				ok = lease.Acquired
			} else {
				ok, err = l.records.AcquirePromotionLease(cctx, ttl)
			}
			cancel()
			if err != nil || !ok {
				l.logger.Warn("renewing the promotion lease failed", "during", what, "acquired", ok, "error", err)
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

// acquireForSwitchover takes the promotion lease, waiting while another
// member holds it briefly: the lease holder's periodic reconcile takes it
// for 4×CheckInterval+2s at a time, a failover for PromotionLeaseTTL. Held
// longer than both, it gives up with [ErrLeaseHeld].
func (l *Loop) acquireForSwitchover(ctx context.Context, ttl time.Duration) error {
	deadline := time.Now().Add(ttl + l.reconcileLeaseTTL())
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		ok, err := l.records.AcquirePromotionLease(cctx, ttl)
		cancel()
		switch {
		case ok:
			return nil
		case time.Now().After(deadline) || ctx.Err() != nil:
			if err != nil {
				return fmt.Errorf("%w: %v", ErrCoordinator, err)
			}
			return ErrLeaseHeld
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// reconcileLeaseTTL is how long a reconcile holds the promotion lease.
func (l *Loop) reconcileLeaseTTL() time.Duration { return 4*l.cfg.CheckInterval + 2*time.Second }

// SwitchoverOutcome names the result of a switchover for metrics and logs.
func SwitchoverOutcome(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, ErrBadTarget):
		return "bad_request"
	case errors.Is(err, ErrNotInSync):
		return "not_in_sync"
	case errors.Is(err, ErrLeaseHeld), errors.Is(err, ErrPromotionRunning):
		return "busy"
	case errors.Is(err, ErrNoCandidate), errors.Is(err, ErrPrimaryNotServing), errors.Is(err, ErrUnsupported):
		return "refused"
	case errors.Is(err, ErrOutcomeUnknown):
		return "unknown"
	}
	return "failed"
}

func (l *Loop) ping(ctx context.Context, addr string) error {
	l.mu.Lock()
	c, ok := l.pingers[addr]
	if !ok {
		t := l.cfg.CheckInterval
		c = redis.NewClient(&redis.Options{Addr: addr, DialTimeout: t, ReadTimeout: t, WriteTimeout: t, MaxRetries: -1, PoolSize: 1,
			Dialer: l.promoter.Dialer})
		l.pingers[addr] = c
	}
	l.mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, 2*l.cfg.CheckInterval)
	defer cancel()
	return c.Ping(cctx).Err()
}

func (l *Loop) closePingers() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.pingers {
		_ = c.Close()
	}
}
