// Package app wires keel-persistence: ops endpoints, the store (Redis
// following the coordinator's group record, or embedded bbolt), the
// coordinator lease, the failover loop and the Connect API, started in that
// order and stopped in reverse.
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
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/persistence/internal/failover"
	"github.com/keelmq/keel/services/persistence/internal/metrics"
	"github.com/keelmq/keel/services/persistence/internal/server"
	"github.com/keelmq/keel/services/persistence/internal/store"
	"github.com/keelmq/keel/services/persistence/internal/store/boltstore"
	"github.com/keelmq/keel/services/persistence/internal/store/redisstore"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// Defaults.
const (
	DefaultAPIAddr     = ":7402"
	DefaultOpsAddr     = ":9102"
	DefaultWaitTimeout = time.Second
	DefaultLeaseMargin = 2 * time.Second
)

// ErrLeaseLost is why writes are refused while the coordinator lease is not
// known to be valid.
var ErrLeaseLost = errors.New("coordinator lease not valid: not acknowledging writes")

// Config is the whole configuration of a persistence process.
type Config struct {
	APIAddr     string        `yaml:"api_addr"`
	OpsAddr     string        `yaml:"ops_addr"`
	Pprof       bool          `yaml:"pprof"`
	LogLevel    string        `yaml:"log_level"`
	LogFormat   string        `yaml:"log_format"`
	StopTimeout time.Duration `yaml:"stop_timeout"`
	MemberID    string        `yaml:"member_id"`
	Incarnation uint64        `yaml:"incarnation"`
	// AdvertiseAddr is the API URL given to the coordinator.
	AdvertiseAddr string `yaml:"advertise_addr"`

	RedisAddr     string              `yaml:"redis_addr"`
	RedisReplicas config.StringList   `yaml:"redis_replicas"`
	RedisGroupID  uint                `yaml:"redis_group_id"`
	MinReplicas   int                 `yaml:"min_replicas"`
	HighWater     float64             `yaml:"high_water"`
	Unreplicated  bool                `yaml:"unreplicated"`
	WaitTimeout   time.Duration       `yaml:"wait_timeout"`
	MaxPipeline   int                 `yaml:"max_pipeline"`
	CommitLanes   int                 `yaml:"commit_lanes"`
	DataDir       string              `yaml:"data_dir"`
	Coordinator   string              `yaml:"coordinator_addr"`
	LeaseMargin   time.Duration       `yaml:"lease_margin"`
	Failover      failover.LoopConfig `yaml:"failover"`
	MaxPayload    int                 `yaml:"max_payload"`
	// TenantQueueMax and TenantQueueMaxFor bound the entries queued for
	// all of a tenant's sessions in one Redis group.
	TenantQueueMax    int               `yaml:"tenant_queue_max"`
	TenantQueueMaxFor config.StringList `yaml:"tenant_queue_max_for"`

	// APIListener, if set, is served instead of binding APIAddr (tests).
	APIListener net.Listener `yaml:"-"`
	// Registry, if set, receives the metrics (tests).
	Registry *prometheus.Registry `yaml:"-"`
	// RedisDialer, if set, opens every connection to Redis (tests cut some).
	RedisDialer func(ctx context.Context, network, addr string) (net.Conn, error) `yaml:"-"`
	Tracing     tracing.Config
}

// RegisterFlags registers every flag.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.APIAddr, "api.addr", DefaultAPIAddr, "Connect API listen address (gRPC, gRPC-Web and Connect; HTTP/1.1 and h2c)")
	fs.StringVar(&c.AdvertiseAddr, "api.advertise-addr", "", "API base URL registered with the coordinator (default http://<hostname><api.addr port>)")
	fs.StringVar(&c.OpsAddr, "ops.addr", DefaultOpsAddr, "address of /metrics, /healthz and /readyz (empty: off)")
	fs.BoolVar(&c.Pprof, "ops.pprof", false, "serve /debug/pprof on the ops address")
	fs.StringVar(&c.LogLevel, "log.level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log.format", "json", "log format: json or text")
	fs.DurationVar(&c.StopTimeout, "stop-timeout", 10*time.Second, "deadline for each shutdown step")
	fs.StringVar(&c.MemberID, "member-id", "", "stable member ID for the coordinator (default: hostname)")
	fs.Uint64Var(&c.Incarnation, "incarnation", 0, "incarnation for the coordinator (default: start time in ns, so each start is higher)")
	fs.StringVar(&c.RedisAddr, "redis.addr", "", "Redis node this instance fronts (host:port); the group's first primary when the coordinator has no record. Empty: embedded store in --data-dir")
	fs.Var(&c.RedisReplicas, "redis.replicas", "the other nodes of the group (host:port, comma-separated), for the first record")
	fs.UintVar(&c.RedisGroupID, "redis.group-id", 0, "Redis group this instance belongs to")
	fs.IntVar(&c.MinReplicas, "redis.min-replicas", 1, "replicas that must confirm each acknowledged write (WAIT n); 0 needs --unreplicated")
	fs.BoolVar(&c.Unreplicated, "unreplicated", false, "acknowledge writes without any replica: an acknowledged message is lost with the primary. Logged and exported as an alert")
	fs.DurationVar(&c.WaitTimeout, "redis.wait-timeout", DefaultWaitTimeout, "WAIT timeout; a write not confirmed in time is answered NOT_REPLICATED")
	fs.IntVar(&c.MaxPipeline, "redis.max-pipeline", 64, "script calls per Redis pipeline (group commit)")
	fs.IntVar(&c.CommitLanes, "redis.commit-lanes", redisstore.DefaultLanes, "pipelines committing at once, each on connections of its own (a session's writes always take the same)")
	fs.Float64Var(&c.HighWater, "redis.high-water", redisstore.DefaultHighWater, "share of the primary's maxmemory above which appends and retained writes are refused (not acknowledged) until memory drains")
	fs.StringVar(&c.DataDir, "data-dir", "data/persistence", "directory of the embedded bbolt store, used when --redis.addr is empty")
	fs.StringVar(&c.Coordinator, "coordinator.addr", "", "coordinator API base URL (http://host:7401); empty: no lease, no failover")
	fs.DurationVar(&c.LeaseMargin, "lease-margin", DefaultLeaseMargin, "stop acknowledging writes this long before the coordinator lease would expire")
	fs.IntVar(&c.MaxPayload, "max-payload", server.DefaultLimits.MaxPayload, "largest message payload accepted, bytes")
	fs.IntVar(&c.TenantQueueMax, "queue.tenant-max", 0, "entries queued for all of a tenant's sessions in this Redis group, beyond which queueing for an offline session is refused (counted; the edge drops that delivery); 0: no bound")
	fs.Var(&c.TenantQueueMaxFor, "queue.tenant-max-for", "tenants with a bound of their own, tenant=entries (comma-separated; 0: no bound), over --queue.tenant-max")
	c.Failover.RegisterFlags(fs, "failover.")
	c.Tracing.RegisterFlags(fs, "tracing.")
}

// TenantQuotas returns the tenants' queue bounds of the configuration.
func (c *Config) TenantQuotas() (store.TenantQuotas, error) {
	q := store.TenantQuotas{Default: c.TenantQueueMax}
	if c.TenantQueueMax < 0 {
		return q, errors.New("queue.tenant-max must be ≥ 0")
	}
	for _, kv := range c.TenantQueueMaxFor {
		tenant, n, ok := strings.Cut(kv, "=")
		v, err := strconv.Atoi(n)
		if !ok || err != nil || v < 0 || !server.ValidTenant(tenant) {
			return q, fmt.Errorf("queue.tenant-max-for %q: want tenant=entries (entries ≥ 0)", kv)
		}
		if q.For == nil {
			q.For = map[string]int{}
		}
		q.For[tenant] = v
	}
	return q, nil
}

// Validate checks the configuration.
func (c *Config) Validate() error {
	var errs []error
	if _, err := c.TenantQuotas(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Tracing.Validate(); err != nil {
		errs = append(errs, err)
	}
	if c.APIAddr == "" && c.APIListener == nil {
		errs = append(errs, errors.New("api.addr is empty"))
	}
	if c.StopTimeout <= 0 {
		errs = append(errs, errors.New("stop-timeout must be positive"))
	}
	if _, err := logging.ParseLevel(c.LogLevel); err != nil {
		errs = append(errs, err)
	}
	if c.RedisAddr == "" && c.DataDir == "" {
		errs = append(errs, errors.New("either redis.addr or data-dir is required"))
	}
	if c.RedisAddr != "" {
		if c.MinReplicas < 0 {
			errs = append(errs, errors.New("redis.min-replicas must not be negative"))
		}
		if c.HighWater <= 0 || c.HighWater > 1 {
			errs = append(errs, fmt.Errorf("redis.high-water %v: want a share of maxmemory in (0, 1]", c.HighWater))
		}
		if c.MinReplicas == 0 && !c.Unreplicated {
			errs = append(errs, errors.New("redis.min-replicas=0 acknowledges unreplicated writes: set --unreplicated to mean it"))
		}
		if c.WaitTimeout <= 0 || c.MaxPipeline <= 0 || c.CommitLanes <= 0 {
			errs = append(errs, errors.New("redis.wait-timeout, redis.max-pipeline and redis.commit-lanes must be positive"))
		}
	}
	if c.Coordinator != "" {
		if err := c.Failover.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if c.MaxPayload <= 0 || c.MaxPayload > 256<<20 {
		errs = append(errs, errors.New("max-payload must be 1 B to 256 MiB"))
	}
	return errors.Join(errs...)
}

// App is a running persistence process.
type App struct {
	cfg     Config
	logger  *slog.Logger
	reg     *prometheus.Registry
	ops     *service.Ops
	metrics *metrics.Metrics
	http    *http.Server
	ln      net.Listener

	store     store.Store
	follower  *failover.Follower
	loop      *failover.Loop
	records   *failover.CoordinatorRecords
	coord     coordinatorv1connect.CoordinatorServiceClient
	coordHTTP *http.Client // coord's
	srv       *server.Server
	slots     slots.Table // the cluster's, read at start (nil: one group)

	leaseUntil atomic.Int64 // unix nanos; writes stop after it
	leaseTTL   atomic.Int64 // nanos: the coordinator's member lease TTL, once known
	paused     atomic.Bool  // writes are not granted: another member fails the group over
}

// New validates and allocates; it opens nothing.
func New(cfg Config, logger *slog.Logger) (*App, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MemberID == "" {
		cfg.MemberID, _ = os.Hostname()
	}
	if cfg.Incarnation == 0 {
		cfg.Incarnation = uint64(time.Now().UnixNano())
	}
	if cfg.Unreplicated {
		cfg.MinReplicas = 0
	}
	a := &App{cfg: cfg, logger: logger, reg: cfg.Registry}
	if a.reg == nil {
		a.reg = service.NewRegistry()
	}
	a.metrics = metrics.New(a.reg)
	a.ops = service.NewOps(cfg.OpsAddr, a.reg, logger.With("component", "ops"))
	a.ops.EnablePprof = cfg.Pprof
	if cfg.Coordinator != "" {
		a.coordHTTP = rpc.LeaseClient()
		a.coord = coordinatorv1connect.NewCoordinatorServiceClient(a.coordHTTP, cfg.Coordinator, rpc.ClientOptions()...)
		a.records = &failover.CoordinatorRecords{Client: a.coord, GroupID: uint32(cfg.RedisGroupID), MemberID: cfg.MemberID, Incarnation: cfg.Incarnation}
	}
	return a, nil
}

// Addr returns the API address once started.
func (a *App) Addr() string {
	if a.ln == nil {
		return ""
	}
	return a.ln.Addr().String()
}

// Ops returns the ops server (tests read its address).
func (a *App) Ops() *service.Ops { return a.ops }

func (a *App) openRedis(addr string) (*redisstore.Store, error) {
	s, err := redisstore.New(redisstore.Config{Addr: addr, MinReplicas: a.cfg.MinReplicas, WaitTimeout: a.cfg.WaitTimeout,
		MaxBatch: a.cfg.MaxPipeline, Lanes: a.cfg.CommitLanes, Dialer: a.cfg.RedisDialer, HighWater: a.cfg.HighWater, MemoryObserver: a.metrics.Memory},
		a.logger.With("component", "redis", "primary", addr))
	if err != nil {
		return nil, err
	}
	s.Observer = a.metrics
	return s, nil
}

// openStore opens the embedded store, or the Redis store following the
// coordinator's record (bootstrapping it from redis.addr if the group has
// none), or without a coordinator the Redis store at redis.addr.
func (a *App) openStore(ctx context.Context) error {
	if a.cfg.RedisAddr == "" {
		if err := os.MkdirAll(a.cfg.DataDir, 0o750); err != nil {
			return fmt.Errorf("data dir: %w", err)
		}
		s, err := boltstore.Open(a.cfg.DataDir)
		if err != nil {
			return err
		}
		s.Observer = a.metrics
		a.store = s
		a.logger.Info("embedded store", "data_dir", a.cfg.DataDir)
		return nil
	}
	if a.cfg.Unreplicated {
		a.metrics.Unreplicated.Set(1)
		a.logger.Error("ALERT: running unreplicated (--unreplicated): acknowledged writes are lost if the Redis primary is lost",
			"redis", a.cfg.RedisAddr)
	}
	if a.records == nil {
		a.logger.Warn("no coordinator: no writer lease and no Redis failover", "redis", a.cfg.RedisAddr)
		s, err := a.openRedis(a.cfg.RedisAddr)
		if err != nil {
			return err
		}
		a.store = s
		return nil
	}
	var k int
	err := retry(ctx, 30*time.Second, func(ctx context.Context) error {
		var err error
		a.slots, k, err = slots.Fetch(ctx, a.coord, a.cfg.MemberID, coordinatorv1.MemberRole_MEMBER_ROLE_PERSISTENCE)
		return err
	})
	if err != nil {
		return fmt.Errorf("read the slot table: %w", err)
	}
	if int(a.cfg.RedisGroupID) >= k {
		return fmt.Errorf("redis.group-id %d: the cluster has %d Redis groups (0 to %d)", a.cfg.RedisGroupID, k, k-1)
	}
	var rec failover.Record
	err = retry(ctx, 30*time.Second, func(ctx context.Context) error {
		var err error
		rec, err = a.records.Bootstrap(ctx, a.cfg.RedisAddr, a.cfg.RedisReplicas, a.cfg.Failover.PromotionLeaseTTL)
		return err
	})
	if err != nil {
		return fmt.Errorf("read or bootstrap group record: %w", err)
	}
	f, err := failover.NewFollower(rec, a.openRedis)
	if err != nil {
		return err
	}
	a.follower, a.store = f, f
	p := &failover.Promoter{Records: a.records, Logger: a.logger.With("component", "promoter"), DialTimeout: a.cfg.Failover.CheckInterval * 4,
		MinReplicas: a.cfg.MinReplicas, Dialer: a.cfg.RedisDialer}
	if a.cfg.Failover.FenceWriters {
		p.WaitWriters = a.waitWriters
	}
	a.loop = failover.NewLoop(a.cfg.Failover, a.records, f, p, a.metrics, a.logger.With("component", "failover"))
	a.metrics.GroupEpoch.Set(float64(rec.Epoch))
	a.logger.Info("following group record", "primary", rec.Primary, "record_epoch", rec.Epoch, "replicas", rec.Replicas, "group", a.cfg.RedisGroupID, "groups", k)
	return nil
}

func retry(ctx context.Context, timeout time.Duration, fn func(context.Context) error) error {
	deadline := time.Now().Add(timeout)
	for {
		cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		err := fn(cctx)
		cancel()
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (a *App) status() *persistencev1.StatusResponse {
	st := &persistencev1.StatusResponse{MemberId: a.cfg.MemberID, Backend: "bolt", MinReplicas: uint32(a.cfg.MinReplicas), Unreplicated: a.cfg.Unreplicated}
	switch s := a.store.(type) {
	case *failover.Follower:
		rec := s.Record()
		st.Backend, st.RedisPrimary, st.GroupRecordEpoch = "redis", rec.Primary, rec.Epoch
	case *redisstore.Store:
		st.Backend, st.RedisPrimary = "redis", s.Addr()
	}
	return st
}

// gate refuses writes when the coordinator lease may have lapsed, or while
// this instance fails its group over: the coordinator pauses the group's
// other writers for a failover, never the one running it.
func (a *App) gate() error {
	if a.coord == nil {
		return nil
	}
	if a.loop != nil {
		if err := a.loop.Gate(); err != nil {
			return err
		}
	}
	if time.Now().UnixNano() >= a.leaseUntil.Load() {
		return ErrLeaseLost
	}
	return nil
}

func (a *App) advertise() string {
	if a.cfg.AdvertiseAddr != "" {
		return a.cfg.AdvertiseAddr
	}
	host, _ := os.Hostname()
	_, port, _ := net.SplitHostPort(a.Addr())
	return "http://" + net.JoinHostPort(host, port)
}

// leaseMargin is the configured margin, but at most a quarter of the TTL:
// renewals come every TTL/3, so a margin beyond that would let the lease
// lapse between two punctual renewals and refuse writes for nothing (a
// cluster run with a short lease TTL).
func (a *App) leaseMargin(ttl time.Duration) time.Duration {
	return min(a.cfg.LeaseMargin, ttl/4)
}

// renew keeps the member lease: every TTL/3, and valid until the TTL
// (measured from sending) minus the margin.
func (a *App) renew(ctx context.Context) error {
	interval := time.Second
	for {
		sent := time.Now()
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		resp, err := a.coord.RenewLease(cctx, connect.NewRequest(a.renewal(coordinatorv1.MemberState_MEMBER_STATE_ALIVE)))
		cancel()
		if err == nil {
			a.renewed(sent, resp.Msg)
			interval = max(resp.Msg.GetRemainingTtl().AsDuration()/3, 100*time.Millisecond)
			if a.paused.Load() || a.loop != nil && a.loop.PrimaryDown() {
				// A failover may be waiting for this instance to hear that
				// it is under way and to say it has paused.
				interval = min(interval, failoverRenewInterval)
			}
		} else {
			a.logger.Warn("lease renewal failed", "error", err)
			interval = 200 * time.Millisecond
			// The next renewal on a new connection, once no call is on this
			// one: it may reach another coordinator behind the same address
			// (a follower cut off from its leader still answers pings).
			rpc.RedialAfter(a.coordHTTP, err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(interval):
		}
	}
}

func (a *App) leave(ctx context.Context) error {
	_, err := a.coord.RenewLease(ctx, connect.NewRequest(a.renewal(coordinatorv1.MemberState_MEMBER_STATE_LEFT)))
	return err
}

// failoverRenewInterval is how often an instance renews its lease while its
// group's primary does not answer or its writes are paused: a failover
// waits for it to learn that it may not write, and to say it stopped.
const failoverRenewInterval = 200 * time.Millisecond

func (a *App) renewal(state coordinatorv1.MemberState) *coordinatorv1.RenewLeaseRequest {
	// Paused means nothing is acknowledged from now on: the gate refuses
	// new writes and is checked again before a written batch is answered.
	return &coordinatorv1.RenewLeaseRequest{MemberId: a.cfg.MemberID, Role: coordinatorv1.MemberRole_MEMBER_ROLE_PERSISTENCE,
		Incarnation: a.cfg.Incarnation, Address: a.advertise(), State: state, RedisGroupId: uint32(a.cfg.RedisGroupID),
		WritesPaused: a.paused.Load()}
}

// renewed takes in a renewal sent at sent: writes are acknowledged until
// the lease, or the write grant when the coordinator gives a shorter one
// (none while another member fails the group over), less the margin.
func (a *App) renewed(sent time.Time, resp *coordinatorv1.RenewLeaseResponse) {
	ttl := resp.GetRemainingTtl().AsDuration()
	a.leaseTTL.Store(int64(ttl))
	valid := ttl
	if g := resp.GetWriteGrant(); g != nil {
		valid = min(valid, g.AsDuration())
	}
	if paused := valid <= 0; a.paused.Swap(paused) != paused {
		if paused {
			a.logger.Warn("writes paused: another member is failing the redis group over")
		} else {
			a.logger.Info("writes granted again")
		}
	}
	a.leaseUntil.Store(sent.Add(valid - a.leaseMargin(ttl)).UnixNano())
}

// waitWriters is the failover's wait for the group's other writers
// ([failover.Promoter.WaitWriters]): until the coordinator reports that
// each has paused under this failover's lease, or one member lease TTL
// has passed, by which time every one has stopped acknowledging: one cut
// off from the coordinator because its lease lapsed, one that renewed
// meanwhile because it was granted no writes. Until then, the old primary
// may still take their writes, through a replica the promoter cannot
// reach.
func (a *App) waitWriters(ctx context.Context) error {
	ttl := time.Duration(a.leaseTTL.Load())
	if ttl <= 0 {
		ttl = defaultMemberLeaseTTL
	}
	start := time.Now()
	deadline := start.Add(ttl)
	a.logger.Info("waiting for the group's other writers to pause before promoting", "at_most", ttl)
	for {
		epoch := a.loop.FailoverLeaseEpoch()
		if epoch == 0 {
			return errors.New("no failover lease held")
		}
		cctx, cancel := context.WithTimeout(ctx, failoverRenewInterval*5)
		lease, err := a.records.FailoverLease(cctx, a.cfg.Failover.PromotionLeaseTTL, epoch)
		cancel()
		if err == nil && !lease.Acquired {
			err = errors.New("the failover lease is no longer held")
		}
		if err == nil && lease.WritersPaused {
			a.logger.Info("every other writer of the group paused or lost its lease", "after", time.Since(start))
			return nil
		}
		if err != nil {
			a.logger.Debug("asking whether the group's writers paused failed", "error", err)
		}
		left := time.Until(deadline)
		if left <= 0 {
			a.logger.Info("waited one member lease TTL for the group's other writers", "after", time.Since(start))
			return nil
		}
		select {
		case <-time.After(min(left, writersPollInterval)):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// writersPollInterval is how often a failover asks whether the group's
// other writers paused.
const writersPollInterval = 100 * time.Millisecond

// defaultMemberLeaseTTL is the coordinator's default member lease TTL,
// waited for when no renewal has said what it is.
const defaultMemberLeaseTTL = 10 * time.Second

// Run serves until ctx ends, then stops in reverse order: readiness off,
// the API drained, the loops stopped, the lease given up, the store closed.
func (a *App) Run(ctx context.Context) error {
	var g service.Group
	g.Add("ops", func(context.Context) error { return a.ops.Start() }, a.ops.Stop)
	g.Add("listener", func(context.Context) error {
		ln := a.cfg.APIListener
		if ln == nil {
			var err error
			if ln, err = net.Listen("tcp", a.cfg.APIAddr); err != nil {
				return err
			}
		}
		ln = rpc.Buffered(ln)
		a.ln = ln
		return nil
	}, nil)
	g.Add("store", a.openStore, func(context.Context) error {
		if a.store == nil {
			return nil
		}
		return a.store.Close()
	})
	if a.coord != nil {
		g.Add("lease", func(ctx context.Context) error {
			return retry(ctx, 30*time.Second, func(ctx context.Context) error {
				// The first renewal must succeed before anything is acknowledged.
				sent := time.Now()
				resp, err := a.coord.RenewLease(ctx, connect.NewRequest(a.renewal(coordinatorv1.MemberState_MEMBER_STATE_ALIVE)))
				if err != nil {
					return err
				}
				a.renewed(sent, resp.Msg)
				return nil
			})
		}, a.leave)
		g.AddRun("lease-renew", a.renew)
		if a.follower != nil || a.cfg.RedisAddr != "" {
			g.AddRun("failover", func(ctx context.Context) error {
				if a.loop == nil {
					return nil
				}
				return a.loop.Run(ctx)
			})
		}
	}
	g.Add("api", func(context.Context) error {
		quotas, _ := a.cfg.TenantQuotas() // checked by Validate
		scfg := server.Config{Limits: server.Limits{MaxPayload: a.cfg.MaxPayload}, Gate: a.gate,
			Slots: a.slots, Group: uint32(a.cfg.RedisGroupID), TenantQueues: quotas}
		if a.loop != nil {
			scfg.Switchover, scfg.DescribeGroup = a.loop.Switchover, a.loop.Describe
		} else if rs, ok := a.store.(*redisstore.Store); ok {
			// One Redis without a coordinator: the group is that node.
			p := &failover.Promoter{DialTimeout: time.Second, Dialer: a.cfg.RedisDialer}
			scfg.DescribeGroup = func(ctx context.Context) (failover.Record, []failover.NodeStatus) {
				rec := failover.Record{Primary: rs.Addr()}
				return rec, p.Describe(ctx, rec)
			}
		}
		a.srv = server.New(scfg, a.store, a.metrics, a.status, a.logger.With("component", "server"))
		mux := http.NewServeMux()
		mux.Handle(a.srv.Handler())
		a.http = &http.Server{Handler: mux, Protocols: rpc.ServerProtocols(), HTTP2: rpc.ServerHTTP2(), ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = a.http.Serve(a.ln) }()
		a.ops.SetReady(true)
		a.logger.Info("persistence ready", "api", a.Addr(), "ops", a.ops.Addr(), "backend", a.status().GetBackend(),
			"member_id", a.cfg.MemberID, "incarnation", strconv.FormatUint(a.cfg.Incarnation, 10))
		return nil
	}, func(ctx context.Context) error {
		a.ops.SetReady(false)
		_ = a.srv.Stop(ctx)
		return a.http.Shutdown(ctx)
	})
	return g.Run(ctx, a.cfg.StopTimeout, a.logger)
}
