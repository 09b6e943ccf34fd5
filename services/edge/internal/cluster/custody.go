package cluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"connectrpc.com/connect"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
)

// Custodian takes custody of one session the coordinator assigned to this
// edge under epoch: it loads the session from the shared store and
// registers its routes. adopted is false when there was nothing to adopt.
type Custodian interface {
	TakeCustody(ctx context.Context, tenant, clientID string, epoch uint64) (adopted bool, err error)
}

// ACLWatcher is told the ACL version of a tenant whenever it changes, and
// every version in force when the watch (re)starts.
type ACLWatcher interface {
	ACLVersion(tenant string, version uint64)
}

// Watch follows the coordinator's cluster watch for this edge. It hands
// the custodian every session assigned to it when another edge's lease
// expired (DESIGN: custody of offline sessions): a session it fails to
// adopt is not lost, it stays assigned to this edge in the coordinator and
// in the store, and its client resumes it here or anywhere else. It tells
// the ACL watcher about ACL version changes.
type Watch struct {
	Client      coordinatorv1connect.CoordinatorServiceClient
	Self        string
	Incarnation func() uint64
	Custodian   Custodian  // nil: custody events are ignored
	ACL         ACLWatcher // nil: ACL versions are ignored
	Logger      *slog.Logger
	// Workers bounds how many sessions are adopted at once (default 16).
	Workers int
	// Silence is how long a stream may bring nothing before it is opened
	// again (default DefaultWatchSilence).
	Silence time.Duration

	progress custodyProgress
}

// AdoptedThrough returns the highest session epoch such that every custody
// assignment received at or below it is done: adopted with its routes
// registered, or found to have moved on. The coordinator keeps a dead
// edge's routes until each custodian reported the epochs it was given.
func (w *Watch) AdoptedThrough() uint64 { return w.progress.through() }

// custodyProgress tracks the custody jobs not done yet, by epoch. Jobs end
// out of order (workers, retries): what is done is everything below the
// lowest epoch still open.
type custodyProgress struct {
	mu      sync.Mutex
	open    map[uint64]int // epoch → jobs not done
	highest uint64         // highest epoch received
}

func (p *custodyProgress) start(epoch uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.open == nil {
		p.open = map[uint64]int{}
	}
	p.open[epoch]++
	p.highest = max(p.highest, epoch)
}

// skip counts assignments this edge does not act on as done.
func (p *custodyProgress) skip(ses []*coordinatorv1.SessionEpoch) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, se := range ses {
		p.highest = max(p.highest, se.GetEpoch())
	}
}

func (p *custodyProgress) done(epoch uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.open[epoch]--; p.open[epoch] <= 0 {
		delete(p.open, epoch)
	}
}

func (p *custodyProgress) through() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	through := p.highest
	for epoch := range p.open {
		through = min(through, epoch-1)
	}
	return through
}

// Run watches until ctx ends, reconnecting after a broken stream and
// resuming after the last event it processed.
func (w *Watch) Run(ctx context.Context) error {
	var from uint64
	jobs := make(chan custodyJob)
	var wg, retries sync.WaitGroup
	workers := w.Workers
	if workers <= 0 {
		workers = 16
	}
	for range workers {
		wg.Go(func() {
			for j := range jobs {
				if w.adopt(ctx, j) {
					w.progress.done(j.se.GetEpoch())
					continue
				}
				// Tried again off the workers, so that one session that
				// keeps failing holds up no other.
				retries.Go(func() {
					for done := false; !done; done = w.adopt(ctx, j) {
						select {
						case <-ctx.Done():
							return
						case <-time.After(custodyBackoff(j.attempt)):
						}
						j.attempt++
					}
					w.progress.done(j.se.GetEpoch())
				})
			}
		})
	}
	defer func() {
		close(jobs)
		wg.Wait()
		retries.Wait()
	}()
	for ctx.Err() == nil {
		err := w.watch(ctx, &from, jobs)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, errWatchSilent) {
			w.Logger.Warn("cluster watch brought nothing, not even a heartbeat; reconnecting", "error", err)
		} else {
			w.Logger.Debug("cluster watch ended; reconnecting", "error", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
	return nil
}

// custodyJob is one session to adopt, and how many tries it had.
type custodyJob struct {
	se      *coordinatorv1.SessionEpoch
	attempt int
}

// custodyBackoff is the wait before try attempt+1: from 250 ms, doubling,
// up to 15 s.
func custodyBackoff(attempt int) time.Duration {
	return min(250*time.Millisecond<<min(attempt, 6), 15*time.Second)
}

// DefaultWatchSilence is how long a watch stream may bring nothing, not
// even the heartbeat the coordinator sends on an idle stream every second,
// before it is given up and opened again. A coordinator that hangs, or a
// connection that stops carrying anything, left the stream waiting for
// good: the connection does not fail while the peer's kernel still
// answers, and custody assignments and ACL changes waited with it.
const DefaultWatchSilence = 5 * time.Second

var errWatchSilent = errors.New("cluster watch silent")

func (w *Watch) watch(ctx context.Context, from *uint64, jobs chan<- custodyJob) error {
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	silence := cmp.Or(w.Silence, DefaultWatchSilence)
	// Only the stream's silence counts: the clock stops while an event is
	// handled (custody can wait for the workers).
	quiet := time.AfterFunc(silence, func() { cancel(fmt.Errorf("%w for %s", errWatchSilent, silence)) })
	defer quiet.Stop()
	stream, err := w.Client.WatchCluster(sctx, connect.NewRequest(&coordinatorv1.WatchClusterRequest{
		MemberId: w.Self, Role: coordinatorv1.MemberRole_MEMBER_ROLE_EDGE, Incarnation: w.Incarnation(), FromIndex: *from}))
	if err != nil {
		return cmp.Or(context.Cause(sctx), err)
	}
	defer stream.Close()
	for {
		quiet.Reset(silence)
		ok := stream.Receive()
		quiet.Stop()
		if !ok {
			break
		}
		ev := stream.Msg()
		if w.ACL != nil {
			for _, a := range ev.GetSnapshot().GetAclVersions() {
				w.ACL.ACLVersion(a.GetTenant(), a.GetVersion())
			}
			if a := ev.GetAclVersion(); a != nil {
				w.ACL.ACLVersion(a.GetTenant(), a.GetVersion())
			}
		}
		if snap := ev.GetSnapshot(); len(snap.GetCustody()) > 0 && w.Custodian == nil {
			w.progress.skip(snap.GetCustody())
		} else if len(snap.GetCustody()) > 0 {
			// The custody assignments this edge may have missed (it watched
			// from a coordinator that could not replay them): adopting a
			// session held already is a no-op.
			w.Logger.Info("custody listed in a watch snapshot", "sessions", len(snap.GetCustody()))
			for _, se := range snap.GetCustody() {
				if err := w.queue(ctx, jobs, se); err != nil {
					return err
				}
			}
		}
		if c := ev.GetCustody(); c != nil && c.GetToEdgeId() == w.Self && w.Custodian == nil {
			// Nothing to adopt here (no shared store): done on arrival, so
			// that the dead edge's routes need not wait for this edge.
			w.progress.skip(c.GetSessions())
		} else if c != nil && c.GetToEdgeId() == w.Self {
			w.Logger.Info("custody assigned", "from_edge", c.GetFromEdgeId(), "from_incarnation", c.GetFromIncarnation(),
				"sessions", len(c.GetSessions()))
			for _, se := range c.GetSessions() {
				if err := w.queue(ctx, jobs, se); err != nil {
					return err
				}
			}
		}
		*from = ev.GetIndex()
	}
	if cause := context.Cause(sctx); errors.Is(cause, errWatchSilent) {
		return cause
	}
	return stream.Err()
}

// queue hands one custody assignment to the workers, counting it open
// until it is done.
func (w *Watch) queue(ctx context.Context, jobs chan<- custodyJob, se *coordinatorv1.SessionEpoch) error {
	w.progress.start(se.GetEpoch())
	select {
	case jobs <- custodyJob{se: se}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// adopt tries once to take custody of one session, and reports whether it
// is done: adopted, or nothing to adopt. A failure (a store or router
// hiccup, a will some recipient did not take) is tried again until it
// succeeds or the session moves on: until then its routes and its will
// depend on it.
func (w *Watch) adopt(ctx context.Context, j custodyJob) bool {
	k := j.se.GetSession()
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	adopted, err := w.Custodian.TakeCustody(actx, k.GetTenant(), k.GetClientId(), j.se.GetEpoch())
	switch {
	case err != nil:
		if ctx.Err() == nil {
			w.Logger.Warn("custody failed; trying again", "tenant", k.GetTenant(), "client_id", k.GetClientId(),
				"epoch", j.se.GetEpoch(), "attempt", j.attempt+1, "error", err)
		}
		return ctx.Err() != nil
	case adopted:
		w.Logger.Debug("session in custody", "tenant", k.GetTenant(), "client_id", k.GetClientId(), "epoch", j.se.GetEpoch())
	}
	return true
}
