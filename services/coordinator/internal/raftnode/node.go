// Package raftnode runs the coordinator's hashicorp/raft instance: durable log
// and stable store, file snapshots, TCP transport, bootstrap, proposals and
// graceful stop with leadership transfer. The state machine itself is package
// fsm; discovery of peers is package discovery.
package raftnode

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/services/coordinator/internal/fsm"
)

// Defaults of [Config].
//
// The timeouts are hashicorp/raft's defaults, kept on purpose: a follower
// notices a dead leader after HeartbeatTimeout (1 s, randomised up to 2 s) and
// an election then takes about one ElectionTimeout, so failover (kill → new
// leader serving) stays under the 3 s target while a GC pause or a slow fsync
// on a loaded node does not trigger needless elections. LeaderLeaseTimeout
// (500 ms) bounds how long a partitioned leader keeps acting as one.
const (
	DefaultHeartbeatTimeout   = time.Second
	DefaultElectionTimeout    = time.Second
	DefaultLeaderLeaseTimeout = 500 * time.Millisecond
	DefaultCommitTimeout      = 50 * time.Millisecond
	DefaultApplyTimeout       = 5 * time.Second
	DefaultSnapshotInterval   = 120 * time.Second
	DefaultSnapshotThreshold  = 8192
	DefaultTrailingLogs       = 10240
	DefaultSnapshotRetain     = 2
)

// maxRPCsInFlight disables AppendEntries pipelining (1 = every replication RPC
// waits for its answer).
//
// NOTE(coordinator): hashicorp/raft v1.7.3 has a pipeline deadlock where a
// follower silently stops receiving entries while heartbeats still flow;
// grafana/pyroscope pins MaxRPCsInFlight = 1 for it (PR #5518). We did not
// verify that v1.8.0 fixes it, and hashicorp's own measurements (raft PR #541)
// show pipelining gains nothing once entries are batched, which ours are
// (claims are batched per entry and BatchApplyCh batches entries per disk
// write). TestCluster_KillLeader restarts a node and checks that it catches up
// while claims keep coming.
const maxRPCsInFlight = 1

// maxAppendEntries is the most entries per AppendEntries RPC and per leader
// disk write (with BatchApplyCh). Each entry is already a batch of claims.
const maxAppendEntries = 128

// Config configures a [Node].
type Config struct {
	NodeID             string        `yaml:"node_id"`
	DataDir            string        `yaml:"data_dir"`
	BindAddr           string        `yaml:"bind_addr"`
	AdvertiseAddr      string        `yaml:"advertise_addr"`
	BootstrapExpect    int           `yaml:"bootstrap_expect"`
	HeartbeatTimeout   time.Duration `yaml:"heartbeat_timeout"`
	ElectionTimeout    time.Duration `yaml:"election_timeout"`
	LeaderLeaseTimeout time.Duration `yaml:"leader_lease_timeout"`
	CommitTimeout      time.Duration `yaml:"commit_timeout"`
	ApplyTimeout       time.Duration `yaml:"apply_timeout"`
	SnapshotInterval   time.Duration `yaml:"snapshot_interval"`
	SnapshotThreshold  uint64        `yaml:"snapshot_threshold"`
	TrailingLogs       uint64        `yaml:"trailing_logs"`

	// Listener, if set, is used instead of binding BindAddr (tests bind
	// 127.0.0.1:0 first to learn the port).
	Listener net.Listener `yaml:"-"`
}

// RegisterFlags registers the flags of c under prefix (e.g. "raft.").
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.StringVar(&c.NodeID, prefix+"node-id", "", "Raft server ID of this node, stable across restarts (default: hostname)")
	fs.StringVar(&c.DataDir, prefix+"data-dir", "data/coordinator", "directory of the Raft log, stable store and snapshots")
	fs.StringVar(&c.BindAddr, prefix+"bind-addr", ":7400", "Raft TCP listen address")
	fs.StringVar(&c.AdvertiseAddr, prefix+"advertise-addr", "", "Raft address peers dial (default: bind address, or the first private IP when it binds all interfaces)")
	fs.IntVar(&c.BootstrapExpect, prefix+"bootstrap-expect", 0, "form a new cluster once this many coordinators are discovered (0: never bootstrap; 1: single node)")
	fs.DurationVar(&c.HeartbeatTimeout, prefix+"heartbeat-timeout", DefaultHeartbeatTimeout, "follower timeout without leader contact before an election")
	fs.DurationVar(&c.ElectionTimeout, prefix+"election-timeout", DefaultElectionTimeout, "candidate timeout without a majority")
	fs.DurationVar(&c.LeaderLeaseTimeout, prefix+"leader-lease-timeout", DefaultLeaderLeaseTimeout, "leader steps down after this long without a majority")
	fs.DurationVar(&c.CommitTimeout, prefix+"commit-timeout", DefaultCommitTimeout, "idle time before the leader sends an AppendEntries to advance commit")
	fs.DurationVar(&c.ApplyTimeout, prefix+"apply-timeout", DefaultApplyTimeout, "how long a proposal may wait to be enqueued")
	fs.DurationVar(&c.SnapshotInterval, prefix+"snapshot-interval", DefaultSnapshotInterval, "how often to check whether to snapshot")
	fs.Uint64Var(&c.SnapshotThreshold, prefix+"snapshot-threshold", DefaultSnapshotThreshold, "snapshot after this many new entries")
	fs.Uint64Var(&c.TrailingLogs, prefix+"trailing-logs", DefaultTrailingLogs, "entries kept after a snapshot so slow followers catch up from the log")
}

// Validate checks c.
func (c *Config) Validate() error {
	var errs []error
	if c.NodeID == "" {
		errs = append(errs, errors.New("raft node id is empty"))
	}
	if c.DataDir == "" {
		errs = append(errs, errors.New("raft data dir is empty"))
	}
	if c.BindAddr == "" && c.Listener == nil {
		errs = append(errs, errors.New("raft bind address is empty"))
	}
	if c.BootstrapExpect < 0 {
		errs = append(errs, errors.New("raft bootstrap-expect is negative"))
	}
	if c.HeartbeatTimeout < 5*time.Millisecond || c.ElectionTimeout < 5*time.Millisecond {
		errs = append(errs, errors.New("raft heartbeat and election timeouts must be at least 5ms"))
	}
	if c.LeaderLeaseTimeout <= 0 || c.LeaderLeaseTimeout > c.HeartbeatTimeout {
		errs = append(errs, errors.New("raft leader lease timeout must be positive and at most the heartbeat timeout"))
	}
	if c.CommitTimeout <= 0 || c.ApplyTimeout <= 0 || c.SnapshotInterval <= 0 {
		errs = append(errs, errors.New("raft commit, apply and snapshot intervals must be positive"))
	}
	if c.SnapshotThreshold == 0 || c.TrailingLogs == 0 {
		errs = append(errs, errors.New("raft snapshot threshold and trailing logs must be positive"))
	}
	return errors.Join(errs...)
}

// Node is one Raft server. Build it with [New], then [Node.Start].
type Node struct {
	cfg    Config
	logger *slog.Logger
	fsm    *fsm.FSM

	store  *BoltStore
	snaps  *raft.FileSnapshotStore
	stream *streamLayer
	trans  *raft.NetworkTransport
	raft   atomic.Pointer[raft.Raft] // set by Start

	leaderCh chan bool

	stopOnce sync.Once
	stopErr  error
}

// New opens the stores and binds the transport but starts no Raft goroutine.
func New(cfg Config, f *fsm.FSM, logger *slog.Logger) (*Node, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = logging.Discard()
	}
	n := &Node{cfg: cfg, logger: logger.With(logging.KeyComponent, "raft"), fsm: f, leaderCh: make(chan bool, 1)}
	if err := os.MkdirAll(cfg.DataDir, 0o750); err != nil {
		return nil, fmt.Errorf("raft data dir: %w", err)
	}
	store, err := OpenBoltStore(filepath.Join(cfg.DataDir, "raft.db"))
	if err != nil {
		return nil, err
	}
	n.store = store
	snaps, err := raft.NewFileSnapshotStoreWithLogger(cfg.DataDir, DefaultSnapshotRetain, NewHCLogger(n.logger))
	if err != nil {
		_ = store.Close()
		return nil, fmt.Errorf("raft snapshot store: %w", err)
	}
	n.snaps = snaps

	ln := cfg.Listener
	if ln == nil {
		if ln, err = net.Listen("tcp", cfg.BindAddr); err != nil {
			_ = store.Close()
			return nil, fmt.Errorf("listen raft %s: %w", cfg.BindAddr, err)
		}
	}
	adv, err := AdvertiseAddr(cfg.AdvertiseAddr, ln.Addr())
	if err != nil {
		_ = ln.Close()
		_ = store.Close()
		return nil, err
	}
	n.stream = newStreamLayer(ln, adv)
	n.trans = raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream:          n.stream,
		MaxPool:         3,
		MaxRPCsInFlight: maxRPCsInFlight,
		Timeout:         10 * time.Second,
		Logger:          NewHCLogger(n.logger.With(logging.KeyComponent, "raft-transport")),
	})
	return n, nil
}

// AdvertiseAddr returns configured, resolved, if set; else bound, with an
// unspecified IP (0.0.0.0, ::) replaced by the first private IP of the host.
func AdvertiseAddr(configured string, bound net.Addr) (net.Addr, error) {
	if configured != "" {
		a, err := net.ResolveTCPAddr("tcp", configured)
		if err != nil {
			return nil, fmt.Errorf("advertise address %q: %w", configured, err)
		}
		return a, nil
	}
	tcp, ok := bound.(*net.TCPAddr)
	if !ok || !tcp.IP.IsUnspecified() {
		return bound, nil
	}
	ip, err := privateIP()
	if err != nil {
		return nil, fmt.Errorf("advertise address: bound to all interfaces and %w; set the advertise address", err)
	}
	return &net.TCPAddr{IP: ip, Port: tcp.Port}, nil
}

func privateIP() (net.IP, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.IsPrivate() {
			return ipn.IP, nil
		}
	}
	return nil, errors.New("no private IP found")
}

// Start starts Raft. It does not bootstrap; see [Node.BootstrapIfEmpty].
func (n *Node) Start() error {
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(n.cfg.NodeID)
	rc.HeartbeatTimeout = n.cfg.HeartbeatTimeout
	rc.ElectionTimeout = n.cfg.ElectionTimeout
	rc.LeaderLeaseTimeout = n.cfg.LeaderLeaseTimeout
	rc.CommitTimeout = n.cfg.CommitTimeout
	rc.SnapshotInterval = n.cfg.SnapshotInterval
	rc.SnapshotThreshold = n.cfg.SnapshotThreshold
	rc.TrailingLogs = n.cfg.TrailingLogs
	rc.MaxAppendEntries = maxAppendEntries
	rc.BatchApplyCh = true
	rc.NotifyCh = n.leaderCh
	rc.NoLegacyTelemetry = true
	rc.Logger = NewHCLogger(n.logger)
	r, err := raft.NewRaft(rc, n.fsm, n.store, n.store, n.snaps, n.trans)
	if err != nil {
		return fmt.Errorf("start raft: %w", err)
	}
	n.raft.Store(r)
	n.logger.Info("raft started", "node_id", n.cfg.NodeID, "addr", string(n.trans.LocalAddr()))
	return nil
}

// ID returns the node's Raft server ID.
func (n *Node) ID() string { return n.cfg.NodeID }

// Addr returns the Raft address peers dial.
func (n *Node) Addr() string { return string(n.trans.LocalAddr()) }

// Raft returns the underlying Raft instance, for status and metrics.
func (n *Node) Raft() *raft.Raft { return n.raft.Load() }

// FSM returns the state machine.
func (n *Node) FSM() *fsm.FSM { return n.fsm }

// LeaderCh reports leadership gained (true) and lost (false). It holds only the
// latest value; there must be a single reader.
func (n *Node) LeaderCh() <-chan bool { return n.leaderCh }

// HasState reports whether this node has Raft state on disk (it was part of a
// cluster before), in which case it must never bootstrap.
func (n *Node) HasState() (bool, error) {
	return raft.HasExistingState(n.store, n.store, n.snaps)
}

// BootstrapIfEmpty bootstraps a cluster of servers if this node has no state.
// Every node of a new cluster calls it with the same servers (see package
// discovery); all but the first are no-ops once the cluster formed.
func (n *Node) BootstrapIfEmpty(servers []raft.Server) (bool, error) {
	has, err := n.HasState()
	if err != nil || has {
		return false, err
	}
	r := n.raft.Load()
	if r == nil {
		return false, ErrNotStarted
	}
	err = r.BootstrapCluster(raft.Configuration{Servers: servers}).Error()
	if errors.Is(err, raft.ErrCantBootstrap) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("bootstrap raft: %w", err)
	}
	n.logger.Info("bootstrapped raft cluster", "servers", len(servers))
	return true, nil
}

// IsLeader reports whether this node is the leader.
func (n *Node) IsLeader() bool {
	r := n.raft.Load()
	return r != nil && r.State() == raft.Leader
}

// Leader returns the leader's ID and Raft address, empty if unknown.
func (n *Node) Leader() (id, addr string) {
	r := n.raft.Load()
	if r == nil {
		return "", ""
	}
	a, i := r.LeaderWithID()
	return string(i), string(a)
}

// Apply proposes one command and waits until the leader applied it. It returns
// the command's result, the entry's index, and the command's refusal if any.
// On a follower it returns an error wrapping [ErrNotLeader].
func (n *Node) Apply(ctx context.Context, t fsm.CommandType, cmd proto.Message) (proto.Message, uint64, error) {
	data, err := fsm.Encode(t, cmd)
	if err != nil {
		return nil, 0, err
	}
	return n.ApplyFuture(ctx, n.ApplyAsync(ctx, data))
}

// ApplyAsync enqueues an encoded command; pair it with [Node.ApplyFuture].
func (n *Node) ApplyAsync(ctx context.Context, data []byte) raft.ApplyFuture {
	timeout := n.cfg.ApplyTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(dl))
	}
	r := n.raft.Load()
	if r == nil {
		return errFuture{ErrNotStarted}
	}
	return r.Apply(data, timeout)
}

// ApplyFuture waits for f and unwraps the FSM's response.
func (n *Node) ApplyFuture(ctx context.Context, f raft.ApplyFuture) (proto.Message, uint64, error) {
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		// The entry may still commit; callers retry with the same request ID.
		return nil, 0, fmt.Errorf("%w: %w", ErrUnknownOutcome, context.Cause(ctx))
	}
	if err != nil {
		return nil, 0, mapRaftErr(err)
	}
	r, _ := f.Response().(*fsm.Response)
	if r == nil {
		return nil, f.Index(), nil
	}
	return r.Msg, f.Index(), r.Err
}

func mapRaftErr(err error) error {
	switch {
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress), errors.Is(err, ErrNotStarted):
		return fmt.Errorf("%w: %w", ErrNotLeader, err)
	case errors.Is(err, raft.ErrLeadershipLost), errors.Is(err, raft.ErrEnqueueTimeout), errors.Is(err, raft.ErrRaftShutdown):
		return fmt.Errorf("%w: %w", ErrUnknownOutcome, err)
	default:
		return fmt.Errorf("raft apply: %w", err)
	}
}

// VerifyLeader confirms with a quorum that this node is still the leader.
// After it returns nil, every write acknowledged before the call is visible in
// this node's FSM, since the leader acknowledges a write only once applied.
func (n *Node) VerifyLeader(ctx context.Context) error {
	r := n.raft.Load()
	if r == nil {
		return ErrNotStarted
	}
	f := r.VerifyLeader()
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		if err != nil {
			return mapRaftErr(err)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%w: %w", ErrUnknownOutcome, context.Cause(ctx))
	}
}

// Barrier waits until every entry before it is applied to the FSM.
func (n *Node) Barrier(timeout time.Duration) error {
	r := n.raft.Load()
	if r == nil {
		return ErrNotStarted
	}
	if err := r.Barrier(timeout).Error(); err != nil {
		return mapRaftErr(err)
	}
	return nil
}

// Servers returns the current Raft configuration.
func (n *Node) Servers() ([]raft.Server, error) {
	r := n.raft.Load()
	if r == nil {
		return nil, ErrNotStarted
	}
	f := r.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, fmt.Errorf("raft configuration: %w", err)
	}
	return f.Configuration().Servers, nil
}

// AddVoter adds (or re-addresses) a voter. Leader only.
func (n *Node) AddVoter(id, addr string) error {
	if err := n.raft.Load().AddVoter(raft.ServerID(id), raft.ServerAddress(addr), 0, 10*time.Second).Error(); err != nil {
		return mapRaftErr(err)
	}
	return nil
}

// RemoveServer removes a server from the configuration. Leader only.
func (n *Node) RemoveServer(id string) error {
	if err := n.raft.Load().RemoveServer(raft.ServerID(id), 0, 10*time.Second).Error(); err != nil {
		return mapRaftErr(err)
	}
	return nil
}

// Isolate cuts the node's Raft transport off (true) or reconnects it (false).
// It is a test seam standing in for a network partition.
func (n *Node) Isolate(iso bool) { n.stream.setIsolated(iso) }

// Shutdown stops the node gracefully: if it leads, it first hands leadership
// to a caught-up follower so that the cluster does not wait out an election
// timeout; then it stops Raft and closes the transport and stores. It is safe
// to call more than once.
func (n *Node) Shutdown(ctx context.Context) error {
	n.stopOnce.Do(func() {
		if n.IsLeader() {
			if err := n.transferLeadership(ctx); err != nil {
				n.logger.Warn("leadership transfer failed", logging.Err(err))
			}
		}
		n.stopErr = n.close()
	})
	return n.stopErr
}

// Kill stops the node without a leadership transfer, as a crash would (the
// log stays as fsynced). For tests.
func (n *Node) Kill() error {
	n.stopOnce.Do(func() { n.stopErr = n.close() })
	return n.stopErr
}

func (n *Node) transferLeadership(ctx context.Context) error {
	servers, err := n.Servers()
	if err != nil {
		return err
	}
	voters := 0
	for _, s := range servers {
		if s.Suffrage == raft.Voter {
			voters++
		}
	}
	if voters < 2 {
		return nil
	}
	f := n.raft.Load().LeadershipTransfer()
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		if err == nil {
			n.logger.Info("leadership transferred")
		}
		return err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (n *Node) close() error {
	var errs []error
	if r := n.raft.Load(); r != nil {
		if err := r.Shutdown().Error(); err != nil {
			errs = append(errs, fmt.Errorf("shut down raft: %w", err))
		}
	}
	if err := n.trans.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close raft transport: %w", err))
	}
	if err := n.store.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close raft store: %w", err))
	}
	return errors.Join(errs...)
}

// errFuture is an ApplyFuture that failed before reaching Raft.
type errFuture struct{ err error }

func (f errFuture) Error() error  { return f.err }
func (f errFuture) Index() uint64 { return 0 }
func (f errFuture) Response() any { return nil }
