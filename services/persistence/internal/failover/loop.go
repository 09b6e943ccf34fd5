package failover

import (
	"context"
	"errors"
	"flag"
	"log/slog"
	"sync"
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
}

// RegisterFlags registers the settings under prefix.
func (c *LoopConfig) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.DurationVar(&c.CheckInterval, prefix+"check-interval", DefaultCheckInterval, "how often to read the group record and ping its primary")
	fs.DurationVar(&c.DownAfter, prefix+"down-after", DefaultDownAfter, "how long the primary must stay unanswering before a replica is promoted")
	fs.DurationVar(&c.PromotionLeaseTTL, prefix+"promotion-lease-ttl", DefaultPromotionLeaseTTL, "promotion lease asked of the coordinator (bounds one promotion)")
	fs.DurationVar(&c.ReconcileInterval, prefix+"reconcile-interval", DefaultReconcileInterval, "how often to demote stray primaries and re-point replicas")
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
	AcquirePromotionLease(ctx context.Context, ttl time.Duration) (bool, error)
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
}

// NewLoop returns a loop; m may be nil.
func NewLoop(cfg LoopConfig, records Leases, f *Follower, p *Promoter, m *metrics.Metrics, logger *slog.Logger) *Loop {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Loop{cfg: cfg, records: records, follower: f, promoter: p, metrics: m, logger: logger, pingers: map[string]*redis.Client{}}
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
			l.gauge(1)
			if time.Since(lastReconcile) >= l.cfg.ReconcileInterval {
				lastReconcile = time.Now()
				l.reconcile(ctx)
			}
			continue
		}
		l.gauge(0)
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
	cctx, cancel := context.WithTimeout(ctx, l.cfg.PromotionLeaseTTL)
	defer cancel()
	ok, err := l.records.AcquirePromotionLease(cctx, l.cfg.PromotionLeaseTTL)
	if err != nil || !ok {
		l.logger.Debug("promotion lease not held", "error", err)
		return false
	}
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
	l.follow(next)
	return true
}

// reconcile demotes stray primaries, holding the promotion lease briefly so
// it never races a promotion in progress elsewhere.
func (l *Loop) reconcile(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, 4*l.cfg.CheckInterval+2*time.Second)
	defer cancel()
	ok, err := l.records.AcquirePromotionLease(cctx, 4*l.cfg.CheckInterval+2*time.Second)
	if err != nil || !ok {
		return
	}
	if err := l.promoter.Reconcile(cctx); err != nil {
		l.logger.Warn("reconciling redis group failed", "error", err)
	}
}

func (l *Loop) ping(ctx context.Context, addr string) error {
	l.mu.Lock()
	c, ok := l.pingers[addr]
	if !ok {
		t := l.cfg.CheckInterval
		c = redis.NewClient(&redis.Options{Addr: addr, DialTimeout: t, ReadTimeout: t, WriteTimeout: t, MaxRetries: -1, PoolSize: 1})
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
