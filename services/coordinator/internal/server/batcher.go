package server

import (
	"context"
	"time"

	"github.com/hashicorp/raft"

	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftnode"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// submission is the claims of one API call, answered together.
type submission struct {
	claims []*raftpb.Claim
	done   chan claimResult // buffered, 1
}

type claimResult struct {
	outcomes []*raftpb.ClaimOutcome
	err      error
}

type entry struct {
	fut   raft.ApplyFuture
	subs  []*submission
	start time.Time
	size  int
}

// batcher packs the claims of concurrent calls into few Raft entries (a
// connect storm is many claims per entry). It takes whatever is queued, up to
// MaxClaimsPerEntry, proposes it without waiting for the previous entry to
// commit (up to maxPipelinedEntries in flight; Raft's BatchApplyCh then writes
// them in one fsync), and answers each call when its entry is applied. There is
// no timer: under low load every claim goes alone, with no added latency.
//
// A session never appears twice in one entry (the FSM would refuse the
// second): a submission that repeats a session already in the batch starts
// the next entry.
type batcher struct {
	s        *Server
	in       chan *submission
	inflight chan *entry
}

func newBatcher(s *Server) *batcher {
	return &batcher{s: s, in: make(chan *submission, 4096), inflight: make(chan *entry, maxPipelinedEntries)}
}

// submit queues claims and waits for their outcomes.
func (b *batcher) submit(ctx context.Context, claims []*raftpb.Claim) ([]*raftpb.ClaimOutcome, error) {
	sub := &submission{claims: claims, done: make(chan claimResult, 1)}
	select {
	case b.in <- sub:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	select {
	case r := <-sub.done:
		return r.outcomes, r.err
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

// run proposes batches until ctx is done, then fails whatever is queued.
func (b *batcher) run(ctx context.Context) {
	var carry *submission // a submission that starts the next entry
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		for e := range b.inflight {
			b.answer(e)
		}
	}()
	defer func() {
		close(b.inflight)
		<-answered
		if carry != nil {
			carry.done <- claimResult{err: raftnode.ErrNotLeader}
		}
		for {
			select {
			case sub := <-b.in:
				sub.done <- claimResult{err: raftnode.ErrNotLeader}
			default:
				return
			}
		}
	}()

	for {
		var first *submission
		if carry != nil {
			first, carry = carry, nil
		} else {
			select {
			case <-ctx.Done():
				return
			case first = <-b.in:
			}
		}
		subs := []*submission{first}
		seen := map[string]struct{}{}
		n := add(seen, first)
	fill:
		for n < b.s.cfg.MaxClaimsPerEntry {
			select {
			case sub := <-b.in:
				if overlaps(seen, sub) {
					carry = sub
					break fill
				}
				n += add(seen, sub)
				subs = append(subs, sub)
			default:
				break fill
			}
		}
		b.propose(ctx, subs, n)
	}
}

func key(c *raftpb.Claim) string { return c.GetTenant() + "\x00" + c.GetClientId() }

func overlaps(seen map[string]struct{}, sub *submission) bool {
	for _, c := range sub.claims {
		if _, ok := seen[key(c)]; ok {
			return true
		}
	}
	return false
}

func add(seen map[string]struct{}, sub *submission) int {
	for _, c := range sub.claims {
		seen[key(c)] = struct{}{}
	}
	return len(sub.claims)
}

func (b *batcher) propose(ctx context.Context, subs []*submission, n int) {
	cmd := &raftpb.ClaimSessionsCommand{NowUnixNano: b.s.now().UnixNano(), Claims: make([]*raftpb.Claim, 0, n)}
	for _, sub := range subs {
		cmd.Claims = append(cmd.Claims, sub.claims...)
	}
	data, err := fsm.Encode(fsm.CmdClaimSessions, cmd)
	if err != nil {
		for _, sub := range subs {
			sub.done <- claimResult{err: err}
		}
		return
	}
	b.s.metrics.claimBatch.Observe(float64(n))
	e := &entry{fut: b.s.node.ApplyAsync(ctx, data), subs: subs, start: time.Now(), size: n}
	b.inflight <- e
}

func (b *batcher) answer(e *entry) {
	msg, _, err := b.s.node.ApplyFuture(context.Background(), e.fut)
	b.s.metrics.applyDuration.WithLabelValues(commandName(fsm.CmdClaimSessions)).Observe(time.Since(e.start).Seconds())
	var outcomes []*raftpb.ClaimOutcome
	if err == nil {
		res, ok := msg.(*raftpb.ClaimSessionsResult)
		if !ok || len(res.GetOutcomes()) != e.size {
			err = raftnode.ErrUnknownOutcome
		}
		outcomes = res.GetOutcomes()
	}
	i := 0
	for _, sub := range e.subs {
		if err != nil {
			sub.done <- claimResult{err: err}
			continue
		}
		sub.done <- claimResult{outcomes: outcomes[i : i+len(sub.claims)]}
		i += len(sub.claims)
	}
}
