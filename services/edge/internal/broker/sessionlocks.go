package broker

import (
	"context"
	"sync"
)

// sessionLocks serialises, per session, the flows by which this edge
// claims a session and takes it in: a CONNECT, the adoption of a draining
// edge's session (Adopt), custody of a dead edge's session (TakeCustody)
// and the resumption of a failed takeover (PreviousOwnerGone). Two of them
// at once would each take the session over from its previous owner under
// their own claim, and the older one, failing, would undo what the newer
// one did: release the newer claim at the coordinator, or end the copy the
// newer one imported. Run one after the other, the second finds the
// session here and binds or keeps it.
//
// Only this edge's own claims wait: the answers to other edges (TakeOver,
// TakeoverEnd) never take a session lock, so two edges claiming one
// session from each other cannot wait on each other.
type sessionLocks struct {
	mu   sync.Mutex
	byID map[string]*sessionLock // guarded by mu
}

type sessionLock struct {
	held chan struct{} // a token while held
	refs int           // holders and waiters; guarded by sessionLocks.mu
}

// lock takes the lock of session id (internal client ID), waiting until
// ctx ends at most. The returned func releases it.
func (l *sessionLocks) lock(ctx context.Context, id string) (unlock func(), err error) {
	l.mu.Lock()
	if l.byID == nil {
		l.byID = map[string]*sessionLock{}
	}
	sl := l.byID[id]
	if sl == nil {
		sl = &sessionLock{held: make(chan struct{}, 1)}
		l.byID[id] = sl
	}
	sl.refs++
	l.mu.Unlock()
	select {
	case sl.held <- struct{}{}:
		return func() {
			<-sl.held
			l.drop(id, sl)
		}, nil
	case <-ctx.Done():
		l.drop(id, sl)
		return nil, ctx.Err()
	}
}

// drop forgets one holder or waiter of sl.
func (l *sessionLocks) drop(id string, sl *sessionLock) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if sl.refs--; sl.refs == 0 {
		delete(l.byID, id)
	}
}
