// Package store embeds an Olric member in the router process and exposes the
// few operations the router needs on its distributed maps: Get, Put, Delete,
// Scan, and the live member list.
//
// NOTE(router): Olric v0.5.7 has no compare-and-set, its Incr/GetPut lock only
// on the executing node and its Lock is approximate, so the router never does a
// read-modify-write of one key from two nodes: see internal/server, where the
// rendezvous owner of a key is its single writer.
package store

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"log"
	"log/slog"
	"net"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/buraksezer/olric"
	olricconfig "github.com/buraksezer/olric/config"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/logging"
)

// Defaults.
const (
	DefaultBindAddr          = "0.0.0.0"
	DefaultPort              = 3320
	DefaultMemberlistPort    = 3322
	DefaultReplicaCount      = 2
	DefaultWriteQuorum       = 2
	DefaultReadQuorum        = 1
	DefaultMemberCountQuorum = 2 // a majority of the default 3 router nodes
	DefaultReadRepair        = true
	DefaultEnv               = "lan"
	DefaultStartTimeout      = 60 * time.Second
)

// Config configures the embedded Olric member.
type Config struct {
	BindAddr          string            `yaml:"bind_addr"`
	Port              int               `yaml:"port"`
	MemberlistAddr    string            `yaml:"memberlist_addr"`
	MemberlistPort    int               `yaml:"memberlist_port"`
	Peers             config.StringList `yaml:"peers"`
	ReplicaCount      int               `yaml:"replica_count"`
	WriteQuorum       int               `yaml:"write_quorum"`
	ReadQuorum        int               `yaml:"read_quorum"`
	MemberCountQuorum int               `yaml:"member_count_quorum"`
	ReadRepair        bool              `yaml:"read_repair"`
	Env               string            `yaml:"env"`
	StartTimeout      time.Duration     `yaml:"start_timeout"`
	// SingleNode sets every replication knob to 1 for a one-node dev setup.
	SingleNode bool `yaml:"single_node"`
}

// RegisterFlags registers the flags of c under prefix (e.g. "olric.").
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.StringVar(&c.BindAddr, prefix+"bind-addr", DefaultBindAddr, "Olric data address: an IP, a host name (resolved to its IP) or 0.0.0.0 (a private IP of this host, as Olric picks it); the resolved IP names this node in the cluster")
	fs.IntVar(&c.Port, prefix+"port", DefaultPort, "Olric data port")
	fs.StringVar(&c.MemberlistAddr, prefix+"memberlist-addr", "", "Olric memberlist address (default: bind-addr)")
	fs.IntVar(&c.MemberlistPort, prefix+"memberlist-port", DefaultMemberlistPort, "Olric memberlist port (separate from Keel's own memberlist)")
	c.Peers = nil
	fs.Var(&c.Peers, prefix+"peers", "comma-separated memberlist host:port of other router nodes")
	fs.IntVar(&c.ReplicaCount, prefix+"replica-count", DefaultReplicaCount, "copies of each route key")
	fs.IntVar(&c.WriteQuorum, prefix+"write-quorum", DefaultWriteQuorum, "copies a write must reach before it succeeds")
	fs.IntVar(&c.ReadQuorum, prefix+"read-quorum", DefaultReadQuorum, "copies a read consults")
	fs.IntVar(&c.MemberCountQuorum, prefix+"member-count-quorum", DefaultMemberCountQuorum, "router nodes that must be up for the table to serve (a majority)")
	fs.BoolVar(&c.ReadRepair, prefix+"read-repair", DefaultReadRepair, "repair stale copies on read")
	fs.StringVar(&c.Env, prefix+"env", DefaultEnv, "memberlist timing profile: local, lan or wan")
	fs.DurationVar(&c.StartTimeout, prefix+"start-timeout", DefaultStartTimeout, "how long to wait for the member quorum at start")
	fs.BoolVar(&c.SingleNode, prefix+"single-node", false, "development: one router node, replica count, quorums 1")
}

// Normalize applies SingleNode.
func (c *Config) Normalize() {
	if c.SingleNode {
		c.ReplicaCount, c.WriteQuorum, c.ReadQuorum, c.MemberCountQuorum = 1, 1, 1, 1
	}
	if c.MemberlistAddr == "" {
		c.MemberlistAddr = c.BindAddr
	}
}

// Validate checks c.
func (c *Config) Validate() error {
	cc := *c
	cc.Normalize()
	var errs []error
	if cc.ReplicaCount < 1 {
		errs = append(errs, errors.New("olric.replica-count must be ≥ 1"))
	}
	if cc.WriteQuorum < 1 || cc.WriteQuorum > cc.ReplicaCount {
		errs = append(errs, errors.New("olric.write-quorum must be in [1, replica-count]"))
	}
	if cc.ReadQuorum < 1 || cc.ReadQuorum > cc.ReplicaCount {
		errs = append(errs, errors.New("olric.read-quorum must be in [1, replica-count]"))
	}
	if cc.MemberCountQuorum < 1 {
		errs = append(errs, errors.New("olric.member-count-quorum must be ≥ 1"))
	}
	if cc.Port <= 0 || cc.Port > 65535 || cc.MemberlistPort <= 0 || cc.MemberlistPort > 65535 {
		errs = append(errs, errors.New("olric.port and olric.memberlist-port must be in 1..65535 (Olric has no ephemeral ports)"))
	}
	switch cc.Env {
	case "local", "lan", "wan":
	default:
		errs = append(errs, fmt.Errorf("olric.env %q: want local, lan or wan", cc.Env))
	}
	return errors.Join(errs...)
}

// ErrNotFound reports a missing key.
var ErrNotFound = errors.New("store: key not found")

// Store is one embedded Olric member.
type Store struct {
	cfg    Config // BindAddr and MemberlistAddr resolved (see resolveConfig)
	logger *slog.Logger
	db     *olric.Olric
	ec     *olric.EmbeddedClient
	dm     olric.DMap

	startErr chan error // Start's result, buffered
	stopOnce sync.Once
	stopErr  error
}

// DMapName is the distributed map holding every router key.
const DMapName = "keel.router"

// New configures the member; nothing listens until Start.
func New(cfg Config, logger *slog.Logger) (*Store, error) {
	cfg.Normalize()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg, err := resolveConfig(cfg)
	if err != nil {
		return nil, err
	}
	db, err := newOlric(cfg, logger)
	if err != nil {
		return nil, err
	}
	return &Store{cfg: cfg, logger: logger, db: db, startErr: make(chan error, 1)}, nil
}

// ResolveAddr returns the IP Olric v0.5.7 binds to, and names its member
// after, for the bind address addr: addr itself for an IP, the first IPv4
// address of a host name (else its first address), and for 0.0.0.0 a
// private IP of this host (go-sockaddr's GetPrivateIP, else its public IP).
// It runs Olric's own code (config.SetupNetworkConfig), so it cannot
// disagree with the names Olric gives members.
func ResolveAddr(addr string) (string, error) {
	oc := olricconfig.New("local")
	oc.BindAddr, oc.BindPort = addr, DefaultPort
	oc.MemberlistConfig.BindAddr, oc.MemberlistConfig.BindPort = addr, DefaultMemberlistPort
	oc.MemberlistConfig.AdvertiseAddr = ""
	if err := oc.SetupNetworkConfig(); err != nil {
		return "", fmt.Errorf("olric bind address %q: %w", addr, err)
	}
	return oc.BindAddr, nil
}

// resolveConfig replaces cfg's bind addresses by the IPs Olric binds to.
//
// NOTE(router): Olric names a member "IP:port" after its resolved bind
// address, not after the address it was given (olric.prepareConfig), and
// that name is all Members reports. The router keys its nodes by member
// name (rendezvous owners, n/<node> API addresses), so it must know its
// own name in that form: with "0.0.0.0" or a host name a node registered
// its API address under a name no member had, and every route forwarded to
// its owner failed with "address of router node …: store: key not found".
// Resolving once here also keeps the name stable across Start's rebuilds.
func resolveConfig(cfg Config) (Config, error) {
	var err error
	if cfg.BindAddr, err = ResolveAddr(cfg.BindAddr); err != nil {
		return cfg, err
	}
	if cfg.MemberlistAddr, err = ResolveAddr(cfg.MemberlistAddr); err != nil {
		return cfg, err
	}
	return cfg, nil
}

// newOlric builds an Olric member from cfg (a fresh configuration each
// time: Olric keeps references into it).
func newOlric(cfg Config, logger *slog.Logger) (*olric.Olric, error) {
	oc := olricconfig.New(cfg.Env)
	oc.BindAddr = cfg.BindAddr
	oc.BindPort = cfg.Port
	oc.MemberlistConfig.BindAddr = cfg.MemberlistAddr
	oc.MemberlistConfig.BindPort = cfg.MemberlistPort
	oc.MemberlistConfig.AdvertisePort = cfg.MemberlistPort
	oc.Peers = slices.Clone([]string(cfg.Peers))
	oc.ReplicaCount = cfg.ReplicaCount
	oc.WriteQuorum = cfg.WriteQuorum
	oc.ReadQuorum = cfg.ReadQuorum
	oc.MemberCountQuorum = int32(cfg.MemberCountQuorum)
	oc.ReadRepair = cfg.ReadRepair
	oc.ReplicationMode = olricconfig.SyncReplicationMode
	oc.BootstrapTimeout = 5 * time.Second
	oc.JoinRetryInterval = 200 * time.Millisecond
	oc.MaxJoinAttempts = 5
	oc.LeaveTimeout = time.Second
	w := &logWriter{logger: logger}
	oc.LogOutput = w
	oc.Logger = log.New(w, "", 0)
	oc.LogLevel = olricconfig.LogLevelWarn
	oc.LogVerbosity = 2
	oc.MemberlistConfig.LogOutput = nil
	oc.MemberlistConfig.Logger = log.New(w, "", 0)
	if err := oc.Sanitize(); err != nil {
		return nil, fmt.Errorf("olric config: %w", err)
	}
	if err := oc.Validate(); err != nil {
		return nil, fmt.Errorf("olric config: %w", err)
	}
	db, err := olric.New(oc)
	if err != nil {
		return nil, fmt.Errorf("olric: %w", err)
	}
	// olric.New named the member in oc (prepareConfig); the router's node
	// ID must be that very name.
	if name := memberName(cfg); oc.MemberlistConfig.Name != name {
		return nil, fmt.Errorf("olric named this member %q, not %q", oc.MemberlistConfig.Name, name)
	}
	return db, nil
}

func memberName(cfg Config) string { return net.JoinHostPort(cfg.BindAddr, strconv.Itoa(cfg.Port)) }

// Name returns this member's name in Olric ("IP:port", the name Members
// reports for it), which the router uses as its node ID.
func (s *Store) Name() string { return memberName(s.cfg) }

// Host returns the IP this member binds to and other members reach it on:
// its bind address as Olric resolved it.
func (s *Store) Host() string { return s.cfg.BindAddr }

// Start joins the cluster and returns once this member can serve reads and
// writes (its member quorum is met), or ctx ends.
//
// Members started at the same moment can disagree on which of them is
// Olric's cluster coordinator, and Olric then fails the loser's start
// ("unrecognized cluster coordinator"); that member is built again and
// started again, a few times, rather than fail the process.
func (s *Store) Start(ctx context.Context) error {
	const attempts = 4
	for attempt := 1; ; attempt++ {
		err := s.start(ctx)
		if err == nil || attempt == attempts || ctx.Err() != nil || !strings.Contains(err.Error(), "unrecognized cluster coordinator") {
			return err
		}
		s.logger.Warn("olric start lost the race for the cluster coordinator; starting this member again", "attempt", attempt, "error", err)
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = s.db.Shutdown(sctx)
		cancel()
		db, nerr := newOlric(s.cfg, s.logger)
		if nerr != nil {
			return nerr
		}
		s.db, s.startErr = db, make(chan error, 1)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(attempt) * 200 * time.Millisecond):
		}
	}
}

func (s *Store) start(ctx context.Context) error {
	go func() { s.startErr <- s.db.Start() }()
	s.ec = s.db.NewEmbeddedClient()
	ctx, cancel := context.WithTimeout(ctx, s.cfg.StartTimeout)
	defer cancel()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case err := <-s.startErr:
			s.startErr <- err
			return fmt.Errorf("olric start: %w", err)
		case <-ctx.Done():
			return fmt.Errorf("olric start: member quorum not met: %w", ctx.Err())
		case <-t.C:
		}
		// NOTE(router): olric's Started callback counts checkpoints in package
		// globals, so with several members in one process (tests) it fires at
		// the wrong time, and EmbeddedClient.Stats reads the member map
		// without its lock (a data race under -race). NewDMap checks member
		// quorum and bootstrap; a Get then proves the partition table works.
		dm, err := s.ec.NewDMap(DMapName)
		if err != nil {
			continue
		}
		if _, err := dm.Get(ctx, "\x00probe"); err != nil && !errors.Is(err, olric.ErrKeyNotFound) {
			continue
		}
		s.dm = dm
		return nil
	}
}

// Stop leaves the cluster. Safe to call more than once.
func (s *Store) Stop(ctx context.Context) error {
	s.stopOnce.Do(func() {
		s.stopErr = s.db.Shutdown(ctx)
	})
	return s.stopErr
}

// Get returns the value of key or [ErrNotFound].
func (s *Store) Get(ctx context.Context, key string) ([]byte, error) {
	r, err := s.dm.Get(ctx, key)
	if errors.Is(err, olric.ErrKeyNotFound) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("olric get: %w", err)
	}
	b, err := r.Byte()
	if err != nil {
		return nil, fmt.Errorf("olric get: %w", err)
	}
	return b, nil
}

// putRetry bounds how long Put retries a missed write quorum.
const putRetry = 3 * time.Second

// Put stores value under key; it returns once the write quorum has it.
//
// NOTE(router): while the partition table settles (a member joined or left),
// Olric v0.5.7 answers ErrWriteQuorum at once, for a few hundred ms, even
// though enough members are up, and a write routed to a member that just
// left and came back at the same address fails with "client is closed"
// (the connection pool to its earlier instance was closed). Put retries
// both for up to putRetry; a Put is idempotent.
func (s *Store) Put(ctx context.Context, key string, value []byte) error {
	deadline := time.Now().Add(putRetry)
	for {
		err := s.dm.Put(ctx, key, value)
		if err == nil {
			return nil
		}
		if !settling(err) || time.Now().After(deadline) {
			return fmt.Errorf("olric put: %w", err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("olric put: %w", err)
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// settling reports whether err is one a write gets while the cluster's
// membership settles (see Put).
func settling(err error) bool {
	return errors.Is(err, olric.ErrWriteQuorum) || strings.Contains(err.Error(), "client is closed")
}

// Delete removes key.
func (s *Store) Delete(ctx context.Context, key string) error {
	if _, err := s.dm.Delete(ctx, key); err != nil && !errors.Is(err, olric.ErrKeyNotFound) {
		return fmt.Errorf("olric delete: %w", err)
	}
	return nil
}

// Scan calls fn for every key starting with prefix, across the cluster.
func (s *Store) Scan(ctx context.Context, prefix string, fn func(key string) bool) error {
	it, err := s.dm.Scan(ctx, olric.Match("^"+regexp.QuoteMeta(prefix)))
	if err != nil {
		return fmt.Errorf("olric scan: %w", err)
	}
	defer it.Close()
	for it.Next() {
		if !fn(it.Key()) {
			return nil
		}
	}
	// A scan that stopped on an error is not the whole prefix: a caller
	// rebuilding state from it must not take it for complete.
	if e, ok := it.(interface{ Err() error }); ok {
		if err := e.Err(); err != nil {
			return fmt.Errorf("olric scan: %w", err)
		}
	}
	return nil
}

// Members returns the names of the live members, sorted, and an identifier
// of that membership which changes when a member restarts under the same
// name too (each member's Olric ID covers its start time): a restart the
// caller's polls missed still reads as a change.
func (s *Store) Members(ctx context.Context) (names []string, view uint64) {
	ms, err := s.ec.Members(ctx)
	if err != nil {
		return nil, 0
	}
	slices.SortFunc(ms, func(a, b olric.Member) int { return strings.Compare(a.Name, b.Name) })
	names = make([]string, 0, len(ms))
	h := fnv.New64a()
	var id [8]byte
	for _, m := range ms {
		names = append(names, m.Name)
		h.Write([]byte(m.Name))
		binary.BigEndian.PutUint64(id[:], m.ID)
		h.Write(id[:])
	}
	return names, h.Sum64()
}

// logWriter turns Olric's and memberlist's log lines into slog records.
type logWriter struct {
	logger *slog.Logger
	mu     sync.Mutex
}

func (w *logWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	sc := bufio.NewScanner(strings.NewReader(string(p)))
	for sc.Scan() {
		line := sc.Text()
		level := slog.LevelDebug
		switch {
		case strings.Contains(line, "[ERR"):
			level = slog.LevelError
		case strings.Contains(line, "[WARN"):
			level = slog.LevelWarn
		}
		w.logger.Log(context.Background(), level, "olric", "line", line)
	}
	return len(p), nil
}

var _ io.Writer = (*logWriter)(nil)
var _ = logging.KeyError
