package failover

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Switchover settings.
const (
	// DefaultSwitchoverSyncTimeout bounds the wait for the target replica
	// to catch up with the paused primary.
	DefaultSwitchoverSyncTimeout = 10 * time.Second
	// MaxSwitchoverSyncTimeout caps it.
	MaxSwitchoverSyncTimeout = 60 * time.Second
	// SwitchoverPromoteBudget bounds the promotion once the target caught
	// up (re-point, promote, stamp, publish, demote). The primary's pause is
	// the sync timeout plus this: if the promoter dies midway, the pause
	// ends by itself.
	SwitchoverPromoteBudget = 10 * time.Second
	// switchoverPoll is how often offsets are compared while waiting.
	switchoverPoll = 5 * time.Millisecond
)

var (
	// ErrBadTarget means the requested target is malformed or no node of
	// the group.
	ErrBadTarget = errors.New("bad switchover target")
	// ErrNotInSync means no candidate replica reached the paused
	// primary's replication offset in time; nothing was changed.
	ErrNotInSync = errors.New("no replica caught up with the paused primary in time")
	// ErrPrimaryNotServing means the recorded primary does not answer as a
	// primary: a dead primary is the automatic failover's job.
	ErrPrimaryNotServing = errors.New("recorded primary not serving")
	// ErrUnsupported means the primary's Redis cannot pause writes only
	// (CLIENT PAUSE WRITE needs Redis 6.2 or later).
	ErrUnsupported = errors.New("redis version does not support CLIENT PAUSE WRITE (needs 6.2+)")
	// ErrLeaseHeld means another member holds the group's promotion lease
	// (a failover, switchover or reconcile runs there).
	ErrLeaseHeld = errors.New("promotion lease held by another member")
	// ErrPromotionRunning means a failover, switchover or reconcile is
	// running in this instance.
	ErrPromotionRunning = errors.New("a promotion is already running in this instance")
	// ErrCoordinator means the coordinator could not be asked.
	ErrCoordinator = errors.New("coordinator unavailable")
	// ErrOutcomeUnknown means the record's compare-and-set got no answer:
	// the switchover may or may not have been published. The old primary
	// is left paused (its pause ends by itself, and with no replica left it
	// cannot acknowledge a write); reconcile aligns the nodes with whatever
	// record is in force.
	ErrOutcomeUnknown = errors.New("switchover outcome unknown")
)

// SwitchoverOptions configures [Promoter.Switchover].
type SwitchoverOptions struct {
	// To is the replica to promote, host:port as in the record; empty
	// picks, among the replicas of the primary, the one with the highest
	// offset once one has caught up.
	To string
	// SyncTimeout bounds the wait for the target to reach the paused
	// primary's offset; 0 is [DefaultSwitchoverSyncTimeout].
	SyncTimeout time.Duration
}

// SwitchoverResult describes a completed switchover.
type SwitchoverResult struct {
	// Old is the record replaced, New the record in force.
	Old, New Record
	// Offset is the paused primary's replication offset, which the new
	// primary had reached when it was promoted.
	Offset int64
	// PausedFor is how long writes were paused on the old primary.
	PausedFor time.Duration
	// Demoted is true when the old primary is now a replica of the new one
	// (and unpaused). Otherwise it stays paused until its pause ends, and
	// reconcile demotes it.
	Demoted bool
}

// ValidateAddr checks a host:port node address.
func ValidateAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%w: %q: %v", ErrBadTarget, addr, err)
	}
	if n, err := strconv.ParseUint(port, 10, 16); host == "" || err != nil || n == 0 {
		return fmt.Errorf("%w: %q: want host:port", ErrBadTarget, addr)
	}
	return nil
}

// Switchover moves the primary of a live group to a replica without losing
// an acknowledged write. The caller must hold the promotion lease (and keep
// it) so that no failover or reconcile runs meanwhile.
//
// Writers keep writing to a live primary while a failover promotes a
// replica, so a write confirmed by WAIT 1 on another replica could be
// missing from the promoted one. So the primary's writes are paused first
// (CLIENT PAUSE WRITE: writers block, they are not refused, so nothing more
// is acknowledged), the target is promoted only once its replication offset
// reached the paused primary's, and the old primary becomes a replica of the
// new one before it is unpaused: the writes it held then fail with READONLY
// and are retried on the new primary by writers that follow the new record.
//
// Until the record is published every failure undoes what was done (the
// replicas follow the old primary again, and it is unpaused).
func (p *Promoter) Switchover(ctx context.Context, opts SwitchoverOptions) (SwitchoverResult, error) {
	if opts.SyncTimeout <= 0 {
		opts.SyncTimeout = DefaultSwitchoverSyncTimeout
	}
	old, err := p.CheckSwitchover(ctx, opts)
	if err != nil {
		return SwitchoverResult{}, err
	}
	nodes := p.nodes(old)

	// The primary must be serving, and able to pause writes only.
	pc := p.client(old.Primary)
	defer pc.Close()
	if err := p.checkPrimary(ctx, pc, old.Primary); err != nil {
		return SwitchoverResult{}, err
	}
	// Candidates: the replicas following it, before anything is paused.
	var cands []string
	for _, addr := range nodes {
		if addr == old.Primary || (opts.To != "" && addr != opts.To) {
			continue
		}
		st := p.state(ctx, addr)
		switch {
		case st.err != nil:
			p.log().Warn("replica unreachable before switchover", "node", addr, "error", st.err)
		case !st.follows(old.Primary) || !st.linkUp:
			p.log().Warn("node is not a live replica of the primary", "node", addr, "role", st.role,
				"master", net.JoinHostPort(st.masterHost, st.masterPort), "link_up", st.linkUp)
		default:
			cands = append(cands, addr)
		}
	}
	if len(cands) == 0 {
		if opts.To != "" {
			return SwitchoverResult{}, fmt.Errorf("%w: %s is not a reachable replica of primary %s with its link up", ErrNoCandidate, opts.To, old.Primary)
		}
		return SwitchoverResult{}, fmt.Errorf("%w: no reachable replica of primary %s with its link up", ErrNoCandidate, old.Primary)
	}

	// 1. Pause the primary's writes. The pause outlasts the whole
	// switchover, so a promoter that dies midway leaves it to end by itself.
	pauseFor := opts.SyncTimeout + SwitchoverPromoteBudget
	pausedAt := time.Now()
	// After the pause, failures report how long it lasted (or has lasted,
	// when the old primary is left paused).
	res := SwitchoverResult{Old: old}
	paused := func() SwitchoverResult { res.PausedFor = time.Since(pausedAt); return res }
	if err := pc.Do(ctx, "CLIENT", "PAUSE", pauseFor.Milliseconds(), "WRITE").Err(); err != nil {
		return SwitchoverResult{Old: old}, fmt.Errorf("pause writes on %s: %w", old.Primary, err)
	}
	unpause := func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := pc.Do(uctx, "CLIENT", "UNPAUSE").Err(); err != nil {
			p.log().Error("unpausing the primary failed; its pause ends by itself", "node", old.Primary, "error", err, "pause", pauseFor)
		}
	}
	// Everything executed before the pause is in the replication stream
	// up to this offset; nothing more is written while paused.
	pinfo, err := pc.Info(ctx, "replication").Result()
	if err != nil {
		unpause()
		return paused(), fmt.Errorf("read offset of paused primary %s: %w", old.Primary, err)
	}
	offset := parseReplication(old.Primary, pinfo).offset
	if p.afterPause != nil {
		p.afterPause()
	}

	// 2. Wait until a candidate holds every byte of it.
	target, err := p.waitInSync(ctx, cands, old.Primary, offset, pausedAt.Add(opts.SyncTimeout))
	if err != nil {
		unpause()
		return paused(), err
	}

	// 3. Promote it as a failover would, strictly: every reachable replica
	// must follow it first.
	pctx, cancel := context.WithDeadline(ctx, pausedAt.Add(pauseFor-time.Second))
	defer cancel()
	next, repointed, err := p.promote(pctx, old, target, nodes, true)
	if err != nil {
		p.rollback(old, target, repointed)
		unpause()
		return paused(), fmt.Errorf("switchover to %s undone: %w", target, err)
	}
	rec, err := p.Records.CompareAndSet(pctx, old.Epoch, next)
	if err != nil && !errors.Is(err, ErrRecordChanged) {
		// No answer: read what is in force.
		rec, err = p.readBack(pctx, old, target)
	}
	switch {
	case err == nil:
	case errors.Is(err, ErrRecordChanged) && rec.Epoch == old.Epoch:
		// Not published (the lease lapsed, say): undo.
		p.rollback(old, target, repointed)
		unpause()
		return paused(), fmt.Errorf("switchover to %s undone: publish record: %w", target, err)
	default:
		// Unknown, or another record is in force: the old primary stays
		// paused (it has no replica left, so once its pause ends it cannot
		// acknowledge a write), and reconcile aligns the nodes with the
		// record.
		p.log().Error("switchover not confirmed: old primary left paused until its pause ends; reconcile aligns the nodes with the record",
			"old_primary", old.Primary, "target", target, "record_primary", rec.Primary, "record_epoch", rec.Epoch, "error", err)
		if !errors.Is(err, ErrOutcomeUnknown) {
			err = fmt.Errorf("%w: now %s at epoch %d", err, rec.Primary, rec.Epoch)
		}
		return paused(), err
	}

	// 4. The record names the new primary: make the old one its replica,
	// then let its held writes go (they fail there with READONLY).
	res.New, res.Offset = rec, offset
	host, port, _ := net.SplitHostPort(target)
	if err := pc.SlaveOf(context.WithoutCancel(pctx), host, port).Err(); err != nil {
		// Left paused: unpaused it would be a primary with no replica
		// (refusing writes under min-replicas-to-write), and reconcile
		// demotes it; but better no writer wakes up on it at all.
		p.log().Error("demoting the old primary failed; it stays paused until its pause ends, and reconcile demotes it",
			"node", old.Primary, "error", err, "pause", pauseFor)
		return paused(), nil
	}
	unpause()
	res.Demoted = true
	return paused(), nil
}

// CheckSwitchover validates opts against the record in force, which it
// returns: a malformed, unknown or current-primary target is [ErrBadTarget].
func (p *Promoter) CheckSwitchover(ctx context.Context, opts SwitchoverOptions) (Record, error) {
	if opts.SyncTimeout < 0 || opts.SyncTimeout > MaxSwitchoverSyncTimeout {
		return Record{}, fmt.Errorf("%w: sync timeout %v: give at most %v", ErrBadTarget, opts.SyncTimeout, MaxSwitchoverSyncTimeout)
	}
	if opts.To != "" {
		if err := ValidateAddr(opts.To); err != nil {
			return Record{}, err
		}
	}
	old, err := p.Records.Get(ctx)
	if err != nil {
		return Record{}, fmt.Errorf("%w: read record: %v", ErrCoordinator, err)
	}
	nodes := p.nodes(old)
	if opts.To == old.Primary {
		return Record{}, fmt.Errorf("%w: %s is already the primary (record epoch %d)", ErrBadTarget, opts.To, old.Epoch)
	}
	if opts.To != "" && !slices.Contains(nodes, opts.To) {
		return Record{}, fmt.Errorf("%w: %s is no node of the group (nodes %s)", ErrBadTarget, opts.To, strings.Join(nodes, ","))
	}
	return old, nil
}

// checkPrimary checks that the recorded primary answers as a primary and
// can pause writes only.
func (p *Promoter) checkPrimary(ctx context.Context, c *redis.Client, addr string) error {
	info, err := c.Info(ctx, "server", "replication").Result()
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrPrimaryNotServing, addr, err)
	}
	if st := parseReplication(addr, info); st.role != "master" {
		return fmt.Errorf("%w: %s is a %s, not a primary (reconcile pending?)", ErrPrimaryNotServing, addr, st.role)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok && !versionAtLeast(v, 6, 2) {
			return fmt.Errorf("%w: %s runs %s", ErrUnsupported, addr, v)
		}
	}
	return nil
}

func versionAtLeast(v string, major, minor int) bool {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return false
	}
	ma, err1 := strconv.Atoi(parts[0])
	mi, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return false
	}
	return ma > major || (ma == major && mi >= minor)
}

// waitInSync polls the candidates until one still follows primary and has
// reached offset, and returns the one with the highest offset among those.
func (p *Promoter) waitInSync(ctx context.Context, cands []string, primary string, offset int64, deadline time.Time) (string, error) {
	seen := map[string]string{}
	for {
		best, bestOff := "", int64(-1)
		for _, addr := range cands {
			st := p.state(ctx, addr)
			switch {
			case st.err != nil:
				seen[addr] = "unreachable: " + st.err.Error()
			case !st.follows(primary):
				seen[addr] = "no longer a replica of " + primary
			default:
				seen[addr] = "offset " + strconv.FormatInt(st.offset, 10)
				if st.offset >= offset && st.offset > bestOff {
					best, bestOff = addr, st.offset
				}
			}
		}
		if best != "" {
			return best, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			var b strings.Builder
			for _, addr := range cands {
				fmt.Fprintf(&b, "; %s: %s", addr, seen[addr])
			}
			return "", fmt.Errorf("%w: primary %s paused at offset %d%s", ErrNotInSync, primary, offset, b.String())
		}
		select {
		case <-ctx.Done():
		case <-time.After(switchoverPoll):
		}
	}
}

// readBack decides an unanswered compare-and-set by reading the record in
// force: no error if it names target above old's epoch, [ErrRecordChanged]
// otherwise, and [ErrOutcomeUnknown] if it cannot be read.
func (p *Promoter) readBack(ctx context.Context, old Record, target string) (Record, error) {
	var lastErr error
	for ctx.Err() == nil {
		rec, err := p.Records.Get(ctx)
		if err == nil {
			if rec.Epoch > old.Epoch && rec.Primary == target {
				return rec, nil
			}
			return rec, fmt.Errorf("%w: compare-and-set not applied", ErrRecordChanged)
		}
		lastErr = err
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
	return Record{}, fmt.Errorf("%w: %v", ErrOutcomeUnknown, lastErr)
}

// rollback makes target and the replicas re-pointed under it follow the
// old primary again. Target's stamp is dropped by its resync.
func (p *Promoter) rollback(old Record, target string, repointed []string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	host, port, _ := net.SplitHostPort(old.Primary)
	for _, addr := range append([]string{target}, repointed...) {
		if err := p.replicaOf(ctx, addr, host, port); err != nil {
			p.log().Error("undoing switchover: node not re-pointed to the primary; reconcile retries", "node", addr, "primary", old.Primary, "error", err)
		}
	}
}
