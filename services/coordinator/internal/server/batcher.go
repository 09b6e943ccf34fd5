package server

import (
	"context"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftnode"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// batchKind is one command the leader batches: claims or releases. I is one
// call's item (a claim, a release), O the FSM's outcome for it.
type batchKind[I, O any] struct {
	cmd fsm.CommandType
	// session names the session an item is about; one appears once per entry.
	session func(I) string
	// command builds the entry of items; outcomes reads its result, nil if
	// the result is not of the command's type.
	command  func(now int64, items []I) proto.Message
	outcomes func(proto.Message) []O
	size     prometheus.Observer // items per entry
}

// claimBatches packs concurrent claims (ClaimSession, ClaimSessions).
var claimBatches = batchKind[*raftpb.Claim, *raftpb.ClaimOutcome]{
	cmd:     fsm.CmdClaimSessions,
	session: func(c *raftpb.Claim) string { return c.GetTenant() + "\x00" + c.GetClientId() },
	command: func(now int64, claims []*raftpb.Claim) proto.Message {
		return &raftpb.ClaimSessionsCommand{NowUnixNano: now, Claims: claims}
	},
	outcomes: func(m proto.Message) []*raftpb.ClaimOutcome {
		res, _ := m.(*raftpb.ClaimSessionsResult)
		return res.GetOutcomes()
	},
}

// releaseBatches packs concurrent releases (ReleaseSession). One entry per
// release made a storm's clean disconnects thousands of entries, applied
// one by one ahead of the next storm's claims.
var releaseBatches = batchKind[*raftpb.ReleaseSessionCommand, *raftpb.ReleaseOutcome]{
	cmd:     fsm.CmdReleaseSessions,
	session: func(r *raftpb.ReleaseSessionCommand) string { return r.GetTenant() + "\x00" + r.GetClientId() },
	command: func(now int64, releases []*raftpb.ReleaseSessionCommand) proto.Message {
		return &raftpb.ReleaseSessionsCommand{NowUnixNano: now, Releases: releases}
	},
	outcomes: func(m proto.Message) []*raftpb.ReleaseOutcome {
		res, _ := m.(*raftpb.ReleaseSessionsResult)
		return res.GetOutcomes()
	},
}

// submission is the items of one API call, answered together.
type submission[I, O any] struct {
	items []I
	done  chan batchResult[O] // buffered, 1
}

type batchResult[O any] struct {
	outcomes []O
	err      error
}

type entry[I, O any] struct {
	fut   raft.ApplyFuture
	subs  []*submission[I, O]
	start time.Time
	size  int
}

// batcher packs the items of concurrent calls into few Raft entries (a
// connect storm is many claims per entry, its disconnects many releases).
// It takes whatever is queued, up to MaxClaimsPerEntry, proposes it without
// waiting for the previous entry to commit (up to maxPipelinedEntries in
// flight; Raft's BatchApplyCh then writes them in one fsync), and answers
// each call when its entry is applied. There is no timer: under low load
// every item goes alone, with no added latency.
//
// A session never appears twice in one entry (the FSM would refuse a second
// claim): a submission that repeats a session already in the batch starts
// the next entry.
type batcher[I, O any] struct {
	s        *Server
	kind     batchKind[I, O]
	in       chan *submission[I, O]
	inflight chan *entry[I, O]
	// stopped is closed once run has answered everything it took: a call
	// that found the term's batcher just as the term ended is told
	// ErrNotLeader (and retries at the new leader), not left to time out.
	stopped chan struct{}
}

func newBatcher[I, O any](s *Server, kind batchKind[I, O], size prometheus.Observer) *batcher[I, O] {
	kind.size = size
	return &batcher[I, O]{s: s, kind: kind, in: make(chan *submission[I, O], 4096),
		inflight: make(chan *entry[I, O], maxPipelinedEntries), stopped: make(chan struct{})}
}

// submit queues items and waits for their outcomes.
func (b *batcher[I, O]) submit(ctx context.Context, items []I) ([]O, error) {
	sub := &submission[I, O]{items: items, done: make(chan batchResult[O], 1)}
	select {
	case b.in <- sub:
	case <-b.stopped:
		return nil, raftnode.ErrNotLeader
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	select {
	case r := <-sub.done:
		return r.outcomes, r.err
	case <-b.stopped:
		select {
		case r := <-sub.done: // answered as run stopped
			return r.outcomes, r.err
		default:
			return nil, raftnode.ErrNotLeader
		}
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
}

// run proposes batches until ctx is done, then fails whatever is queued.
func (b *batcher[I, O]) run(ctx context.Context) {
	var carry *submission[I, O] // a submission that starts the next entry
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
			carry.done <- batchResult[O]{err: raftnode.ErrNotLeader}
		}
		for {
			select {
			case sub := <-b.in:
				sub.done <- batchResult[O]{err: raftnode.ErrNotLeader}
			default:
				close(b.stopped)
				return
			}
		}
	}()

	for {
		var first *submission[I, O]
		if carry != nil {
			first, carry = carry, nil
		} else {
			select {
			case <-ctx.Done():
				return
			case first = <-b.in:
			}
		}
		subs := []*submission[I, O]{first}
		seen := map[string]struct{}{}
		n := b.add(seen, first)
	fill:
		for n < b.s.cfg.MaxClaimsPerEntry {
			select {
			case sub := <-b.in:
				if b.overlaps(seen, sub) {
					carry = sub
					break fill
				}
				n += b.add(seen, sub)
				subs = append(subs, sub)
			default:
				break fill
			}
		}
		b.propose(ctx, subs, n)
	}
}

func (b *batcher[I, O]) overlaps(seen map[string]struct{}, sub *submission[I, O]) bool {
	for _, it := range sub.items {
		if _, ok := seen[b.kind.session(it)]; ok {
			return true
		}
	}
	return false
}

func (b *batcher[I, O]) add(seen map[string]struct{}, sub *submission[I, O]) int {
	for _, it := range sub.items {
		seen[b.kind.session(it)] = struct{}{}
	}
	return len(sub.items)
}

func (b *batcher[I, O]) propose(ctx context.Context, subs []*submission[I, O], n int) {
	items := make([]I, 0, n)
	for _, sub := range subs {
		items = append(items, sub.items...)
	}
	data, err := fsm.Encode(b.kind.cmd, b.kind.command(b.s.now().UnixNano(), items))
	if err != nil {
		for _, sub := range subs {
			sub.done <- batchResult[O]{err: err}
		}
		return
	}
	b.kind.size.Observe(float64(n))
	e := &entry[I, O]{fut: b.s.node.ApplyAsync(ctx, data), subs: subs, start: time.Now(), size: n}
	b.inflight <- e
}

func (b *batcher[I, O]) answer(e *entry[I, O]) {
	msg, _, err := b.s.node.ApplyFuture(context.Background(), e.fut)
	b.s.metrics.applyDuration.WithLabelValues(commandName(b.kind.cmd)).Observe(time.Since(e.start).Seconds())
	var outcomes []O
	if err == nil {
		if outcomes = b.kind.outcomes(msg); len(outcomes) != e.size {
			err = raftnode.ErrUnknownOutcome
		}
	}
	i := 0
	for _, sub := range e.subs {
		if err != nil {
			sub.done <- batchResult[O]{err: err}
			continue
		}
		sub.done <- batchResult[O]{outcomes: outcomes[i : i+len(sub.items)]}
		i += len(sub.items)
	}
}
