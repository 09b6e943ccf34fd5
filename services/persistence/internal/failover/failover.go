// Package failover promotes a replica when a Redis group's primary fails,
// and keeps every other node of the group a replica of the recorded primary.
//
// The record of which node is the primary lives in the coordinator (Raft)
// and is the single authority: a promotion is published there, with a new
// record epoch, only after the promoted node accepts writes under that
// epoch. Before promoting, the promoter waits for the leases of the old
// primary's writers to expire, so no writer still acknowledges through it.
package failover

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keelmq/keel/services/persistence/internal/store/redisstore"
)

// Record is a group's primary as the coordinator holds it.
type Record struct {
	Primary  string   // host:port
	Replicas []string // host:port of the other nodes of the group
	Epoch    uint64
}

// Records reads and compare-and-sets a group's record (the coordinator).
type Records interface {
	Get(ctx context.Context) (Record, error)
	// CompareAndSet replaces the record if its epoch is still oldEpoch and
	// returns the record now in force; the store of the record may assign
	// the new epoch itself (the coordinator uses the Raft index), which is
	// always above oldEpoch. It returns [ErrRecordChanged] if it lost.
	CompareAndSet(ctx context.Context, oldEpoch uint64, next Record) (Record, error)
}

var (
	// ErrNoCandidate means no replica could be promoted.
	ErrNoCandidate = errors.New("no replica can be promoted")
	// ErrRecordChanged means a compare-and-set lost: the record moved on.
	ErrRecordChanged = errors.New("group record changed")
	// ErrNoRecord means the group has no record yet.
	ErrNoRecord = errors.New("group has no record")
	// ErrReplicaUnreachable means a failover found a replica it could not
	// read: an acknowledged write (WAIT 1) may be on that replica alone, so
	// promoting another would lose it. The failover waits for it instead.
	ErrReplicaUnreachable = errors.New("a replica did not answer")
)

// GroupEpochKey is where each node keeps the record epoch it serves under;
// the store's scripts refuse writers that follow an older record.
const GroupEpochKey = "keel:group-epoch"

// Promoter runs failover for one group.
type Promoter struct {
	// Nodes are every node of the group, host:port; empty means the
	// record's primary and replicas.
	Nodes   []string
	Records Records
	// WaitWriters blocks until the leases of every writer that followed
	// the old record have expired (the coordinator knows them).
	WaitWriters func(ctx context.Context) error
	Logger      *slog.Logger
	// MinReplicas is how many replicas confirm each acknowledged write (the
	// writers' WAIT n; 0 counts as 1). Every acknowledged write is on that
	// many replicas at least, so a failover may promote while fewer than
	// that many replicas are unreachable, and waits otherwise.
	MinReplicas int
	// DialTimeout bounds each call to a node.
	DialTimeout time.Duration
	// Dialer, if set, opens the connections to the nodes (tests cut them).
	Dialer func(ctx context.Context, network, addr string) (net.Conn, error)

	// afterPause, if set, runs in a switchover right after the primary is
	// paused (tests).
	afterPause func()
}

type replState struct {
	addr string
	role string
	// offset is the replication offset, comparable only between nodes of
	// one replication ID (replid): a restarted node reports 1 under a new
	// one, whatever data it loaded.
	offset int64
	replid string
	// held is what the node's data holds, which a failover compares (read
	// by position, not by state).
	held held
	// masterHost, masterPort and linkUp describe a replica's link.
	masterHost, masterPort string
	linkUp                 bool
	err                    error
}

// follows reports whether the node is a replica of primary (host:port).
// Host and port are compared whole: a replica of 10.0.0.12 does not follow
// 10.0.0.1, which a reconcile would otherwise leave where it is.
func (st replState) follows(primary string) bool {
	host, port, _ := net.SplitHostPort(primary)
	return st.role == "slave" && st.masterHost == host && st.masterPort == port
}

func (p *Promoter) client(addr string) *redis.Client {
	t := p.DialTimeout
	if t <= 0 {
		t = time.Second
	}
	return redis.NewClient(&redis.Options{Addr: addr, DialTimeout: t, ReadTimeout: t, WriteTimeout: t, MaxRetries: -1, Dialer: p.Dialer})
}

// held places a node's data in the group's history by the marks every
// write leaves in it ([redisstore.WriteSeqKey]): the highest group record
// epoch its writes were admitted under, then how many writing calls it
// holds.
type held struct{ epoch, seq uint64 }

func (h held) cmp(o held) int {
	if c := cmp.Compare(h.epoch, o.epoch); c != 0 {
		return c
	}
	return cmp.Compare(h.seq, o.seq)
}

// ahead reports whether st holds more of the group's history than o. Equal
// marks hold the same writing calls; then, within one replication ID, the
// higher offset has applied more (deletes outside the marks, say).
func (st replState) ahead(o replState) bool {
	if c := st.held.cmp(o.held); c != 0 {
		return c > 0
	}
	return st.replid != "" && st.replid == o.replid && st.offset > o.offset
}

func (p *Promoter) state(ctx context.Context, addr string) replState {
	st, _ := p.read(ctx, addr, false)
	return st
}

// position is state and the node's marks. A node loading its data answers
// LOADING: unreachable, as it is for a failover.
func (p *Promoter) position(ctx context.Context, addr string) replState {
	st, _ := p.read(ctx, addr, true)
	return st
}

// read reads a node's replication state, with marks its write marks, on
// one connection; it also returns the INFO text, which holds the extra
// sections asked for.
func (p *Promoter) read(ctx context.Context, addr string, marks bool, sections ...string) (replState, string) {
	c := p.client(addr)
	defer c.Close()
	info, err := c.Info(ctx, append([]string{"replication"}, sections...)...).Result()
	if err != nil {
		return replState{addr: addr, err: err}, ""
	}
	st := parseReplication(addr, info)
	if !marks {
		return st, info
	}
	v, err := c.MGet(ctx, redisstore.WriteEpochKey, redisstore.WriteSeqKey).Result()
	if err != nil {
		return replState{addr: addr, err: fmt.Errorf("read write marks: %w", err)}, ""
	}
	for i, dst := range []*uint64{&st.held.epoch, &st.held.seq} {
		if s, ok := v[i].(string); ok {
			if *dst, err = strconv.ParseUint(s, 10, 64); err != nil {
				return replState{addr: addr, err: fmt.Errorf("read write marks: %q: %w", s, err)}, ""
			}
		}
	}
	return st, info
}

func parseReplication(addr, info string) replState {
	st := replState{addr: addr}
	redisstore.EachInfoField(info, func(k, v string) {
		switch k {
		case "role":
			st.role = v
		case "slave_repl_offset":
			st.offset, _ = strconv.ParseInt(v, 10, 64)
		case "master_repl_offset":
			if st.role == "master" {
				st.offset, _ = strconv.ParseInt(v, 10, 64)
			}
		case "master_host":
			st.masterHost = v
		case "master_port":
			st.masterPort = v
		case "master_replid":
			st.replid = v
		case "master_link_status":
			st.linkUp = v == "up"
		}
	})
	return st
}

func (p *Promoter) nodes(rec Record) []string {
	if len(p.Nodes) > 0 {
		return p.Nodes
	}
	return append([]string{rec.Primary}, rec.Replicas...)
}

// Failover promotes the replica whose data is furthest along the group's
// history ([held]) and publishes it as the new primary. Fewer than MinReplicas replicas may be
// unreachable: as many may hold acknowledged writes no other has
// (ErrReplicaUnreachable). It is safe to run from two places: the
// record's compare-and-set lets only one promotion win.
//
// Order matters. The other replicas are first re-pointed to the chosen one
// (chained below it, they keep every byte it has); then it is promoted,
// which cuts the old primary off from its last replica, so a still-running
// old primary refuses writes (min-replicas-to-write) and WAIT on it can no
// longer confirm anything the new primary lacks. It then takes a group
// epoch above the old record's, so writers of the old record are fenced,
// and only then is the record published.
func (p *Promoter) Failover(ctx context.Context) (Record, error) {
	old, err := p.Records.Get(ctx)
	if err != nil {
		return Record{}, fmt.Errorf("read record: %w", err)
	}
	if p.WaitWriters != nil {
		if err := p.WaitWriters(ctx); err != nil {
			return Record{}, fmt.Errorf("wait for writer leases: %w", err)
		}
	}
	nodes := p.nodes(old)
	var best *replState
	var unreachable []string
	for _, addr := range nodes {
		if addr == old.Primary {
			continue
		}
		st := p.position(ctx, addr)
		if st.err != nil {
			p.log().Warn("replica unreachable during failover", "node", addr, "error", st.err)
			unreachable = append(unreachable, addr)
			continue
		}
		if best == nil || st.ahead(*best) {
			s := st
			best = &s
		}
	}
	if len(unreachable) >= max(p.MinReplicas, 1) {
		// Every acknowledged write is on MinReplicas replicas at least,
		// which may be exactly those that do not answer: the highest
		// offset among the others is not enough. A group of a primary and
		// two replicas (WAIT 1) loses no availability by this, as a
		// promoted node without a replica refuses writes anyway.
		return Record{}, fmt.Errorf("%w: %s, with every acknowledged write on %d replica(s) at least; not promoting until more answer",
			ErrReplicaUnreachable, strings.Join(unreachable, ", "), max(p.MinReplicas, 1))
	}
	if best == nil {
		return Record{}, ErrNoCandidate
	}
	next, _, err := p.promote(ctx, old, best.addr, nodes, false)
	if err != nil {
		return Record{}, err
	}
	rec, err := p.Records.CompareAndSet(ctx, old.Epoch, next)
	if err != nil {
		return Record{}, fmt.Errorf("publish record: %w", err)
	}
	p.log().Info("redis primary promoted", "primary", rec.Primary, "record_epoch", rec.Epoch,
		"write_epoch", best.held.epoch, "write_seq", best.held.seq, "offset", best.offset)
	return rec, nil
}

// promote makes target the primary of the group whose record is old, all
// but the publication of the record: it re-points every other replica (not
// the old primary) under target, promotes it and stamps a group epoch above
// old's. It returns the record to publish and the replicas it re-pointed.
// With strict, a replica that answers but refuses to be re-pointed fails
// the promotion before target is promoted (a switchover, where the old
// primary is alive and that replica could keep confirming its writes);
// otherwise it is logged and left to reconcile.
func (p *Promoter) promote(ctx context.Context, old Record, target string, nodes []string, strict bool) (Record, []string, error) {
	host, port, _ := net.SplitHostPort(target)
	next := Record{Primary: target}
	var repointed []string
	for _, addr := range nodes {
		if addr == target {
			continue
		}
		next.Replicas = append(next.Replicas, addr)
		if addr == old.Primary {
			continue
		}
		if err := p.replicaOf(ctx, addr, host, port); err != nil {
			if strict && p.state(ctx, addr).err == nil {
				return Record{}, repointed, fmt.Errorf("repoint replica %s under %s: %w", addr, target, err)
			}
			p.log().Warn("repoint replica failed; reconcile retries", "node", addr, "error", err)
			continue
		}
		repointed = append(repointed, addr)
	}
	c := p.client(target)
	defer c.Close()
	if err := c.SlaveOf(ctx, "NO", "ONE").Err(); err != nil {
		return Record{}, repointed, fmt.Errorf("promote %s: %w", target, err)
	}
	// The new primary refuses writes until a replica is attached
	// (min-replicas-to-write). The stamp old.Epoch+1 fences every writer of
	// the old record and admits the new record's writers, whose epoch is
	// always above old.Epoch.
	if err := p.stampEpoch(ctx, c, old.Epoch+1); err != nil {
		return Record{}, repointed, fmt.Errorf("stamp record epoch on %s: %w", target, err)
	}
	return next, repointed, nil
}

func (p *Promoter) stampEpoch(ctx context.Context, c *redis.Client, epoch uint64) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := c.Set(ctx, GroupEpochKey, epoch, 0).Err()
		if err == nil {
			return p.waitReplicated(ctx, c, 5*time.Second)
		}
		if !strings.HasPrefix(err.Error(), "NOREPLICAS") || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// waitReplicated waits up to bound for a replica to have the node's
// writes, as a best effort: WAIT in steps shorter than the client's read
// timeout, which a single WAIT for the whole bound outlasted whenever the
// replica took longer than that to sync (the promotion then failed with
// an i/o timeout).
func (p *Promoter) waitReplicated(ctx context.Context, c *redis.Client, bound time.Duration) error {
	step := c.Options().ReadTimeout / 2
	if step < 100*time.Millisecond {
		step = 100 * time.Millisecond
	}
	for deadline := time.Now().Add(bound); ; {
		n, err := c.Do(ctx, "WAIT", 1, step.Milliseconds()).Int()
		if err != nil || n >= 1 || !time.Now().Before(deadline) {
			return err
		}
	}
}

func (p *Promoter) replicaOf(ctx context.Context, addr, host, port string) error {
	c := p.client(addr)
	defer c.Close()
	return c.SlaveOf(ctx, host, port).Err()
}

// Reconcile makes every reachable node other than the recorded primary a
// replica of it: a returning old primary is demoted before it can take a
// write under the current record (its data past the promotion is dropped by
// the full resync).
func (p *Promoter) Reconcile(ctx context.Context) error {
	rec, err := p.Records.Get(ctx)
	if err != nil {
		return err
	}
	host, port, _ := net.SplitHostPort(rec.Primary)
	var errs []error
	for _, addr := range p.nodes(rec) {
		if addr == rec.Primary {
			continue
		}
		st := p.state(ctx, addr)
		if st.err != nil {
			continue // down; reconciled when it returns
		}
		if !st.follows(rec.Primary) {
			p.log().Warn("demoting node to replica of the recorded primary", "node", addr, "primary", rec.Primary)
			if err := p.replicaOf(ctx, addr, host, port); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// NeedsReconcile reports whether a reachable node other than the recorded
// primary is not its replica: a read-only check, so that the promotion
// lease is taken (and kept from a switchover) only when there is something
// to reconcile.
func (p *Promoter) NeedsReconcile(ctx context.Context) (bool, error) {
	rec, err := p.Records.Get(ctx)
	if err != nil {
		return false, err
	}
	for _, addr := range p.nodes(rec) {
		if addr == rec.Primary {
			continue
		}
		if st := p.state(ctx, addr); st.err == nil && !st.follows(rec.Primary) {
			return true, nil
		}
	}
	return false, nil
}

func (p *Promoter) log() *slog.Logger {
	if p.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return p.Logger
}
