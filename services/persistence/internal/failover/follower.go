package failover

import (
	"context"
	"sync"

	"github.com/keelmq/keel/services/persistence/internal/store"
	"github.com/keelmq/keel/services/persistence/internal/store/redisstore"
)

// Follower is a [store.Store] that writes to the primary of the group record
// it was last told to follow: [Follower.Follow] re-points it. Writes in
// flight on the old primary when it switches fail (retryable), never
// succeed silently on the wrong node.
type Follower struct {
	open func(addr string) (*redisstore.Store, error)

	mu  sync.RWMutex
	cur *redisstore.Store
	rec Record
}

var (
	_ store.Store   = (*Follower)(nil)
	_ store.Batcher = (*Follower)(nil)
)

// NewFollower returns a follower of rec; open connects a store to a primary.
func NewFollower(rec Record, open func(addr string) (*redisstore.Store, error)) (*Follower, error) {
	s, err := open(rec.Primary)
	if err != nil {
		return nil, err
	}
	s.SetGroupEpoch(rec.Epoch)
	return &Follower{open: open, cur: s, rec: rec}, nil
}

// Record returns the record followed.
func (f *Follower) Record() Record {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.rec
}

// Follow re-points the store at rec's primary if it moved, and writes under
// rec's epoch from now on. It reports whether anything changed. An older
// record than the one followed is ignored.
func (f *Follower) Follow(rec Record) (bool, error) {
	f.mu.Lock()
	if rec.Epoch < f.rec.Epoch || (rec.Epoch == f.rec.Epoch && rec.Primary == f.rec.Primary) {
		f.mu.Unlock()
		return false, nil
	}
	if rec.Primary == f.rec.Primary {
		f.cur.SetGroupEpoch(rec.Epoch)
		f.rec = rec
		f.mu.Unlock()
		return true, nil
	}
	s, err := f.open(rec.Primary)
	if err != nil {
		f.mu.Unlock()
		return false, err
	}
	s.SetGroupEpoch(rec.Epoch)
	old := f.cur
	f.cur, f.rec = s, rec
	f.mu.Unlock()
	// The old primary may be dead: its store's writer can take a dial or
	// read timeout to give up the batch it is on, seconds in which the
	// failover loop would neither ping nor publish that it follows the new
	// record. New writes go to the new store already.
	go func() { _ = old.Close() }()
	return true, nil
}

func (f *Follower) get() *redisstore.Store {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.cur
}

// Close closes the current store.
func (f *Follower) Close() error { return f.get().Close() }

// Submit implements [store.Batcher].
func (f *Follower) Submit(ctx context.Context, ops []store.Op) func() []store.OpResult {
	return f.get().Submit(ctx, ops)
}

// Activate implements [store.Store].
func (f *Follower) Activate(ctx context.Context, k store.SessionKey, fe store.Fence) error {
	return f.get().Activate(ctx, k, fe)
}

// PutSession implements [store.Store].
func (f *Follower) PutSession(ctx context.Context, k store.SessionKey, fe store.Fence, s store.Session) error {
	return f.get().PutSession(ctx, k, fe, s)
}

// DeleteSession implements [store.Store].
func (f *Follower) DeleteSession(ctx context.Context, k store.SessionKey, fe store.Fence) error {
	return f.get().DeleteSession(ctx, k, fe)
}

// PutSubscription implements [store.Store].
func (f *Follower) PutSubscription(ctx context.Context, k store.SessionKey, fe store.Fence, sub store.Subscription) error {
	return f.get().PutSubscription(ctx, k, fe, sub)
}

// DeleteSubscription implements [store.Store].
func (f *Follower) DeleteSubscription(ctx context.Context, k store.SessionKey, fe store.Fence, filter string) error {
	return f.get().DeleteSubscription(ctx, k, fe, filter)
}

// Append implements [store.Store].
func (f *Follower) Append(ctx context.Context, k store.SessionKey, fe store.Fence, lim store.QueueLimits, es []store.Entry, ms []*store.Message) (store.AppendResult, error) {
	return f.get().Append(ctx, k, fe, lim, es, ms)
}

// Send implements [store.Store].
func (f *Follower) Send(ctx context.Context, k store.SessionKey, fe store.Fence, es []store.Entry) error {
	return f.get().Send(ctx, k, fe, es)
}

// Pubrel implements [store.Store].
func (f *Follower) Pubrel(ctx context.Context, k store.SessionKey, fe store.Fence, pid uint16) error {
	return f.get().Pubrel(ctx, k, fe, pid)
}

// Complete implements [store.Store].
func (f *Follower) Complete(ctx context.Context, k store.SessionKey, fe store.Fence, pids []uint16) error {
	return f.get().Complete(ctx, k, fe, pids)
}

// Dequeue implements [store.Store].
func (f *Follower) Dequeue(ctx context.Context, k store.SessionKey, fe store.Fence, ids []string) error {
	return f.get().Dequeue(ctx, k, fe, ids)
}

// PutIncoming implements [store.Store].
func (f *Follower) PutIncoming(ctx context.Context, k store.SessionKey, fe store.Fence, in store.Incoming) error {
	return f.get().PutIncoming(ctx, k, fe, in)
}

// DeleteIncoming implements [store.Store].
func (f *Follower) DeleteIncoming(ctx context.Context, k store.SessionKey, fe store.Fence, pid uint16) error {
	return f.get().DeleteIncoming(ctx, k, fe, pid)
}

// Load implements [store.Store].
func (f *Follower) Load(ctx context.Context, k store.SessionKey) (*store.State, error) {
	return f.get().Load(ctx, k)
}

// PutRetained implements [store.Store].
func (f *Follower) PutRetained(ctx context.Context, tenant string, m *store.Message) (bool, error) {
	return f.get().PutRetained(ctx, tenant, m)
}

// LookupRetained implements [store.Store].
func (f *Follower) LookupRetained(ctx context.Context, tenant, filter string, limit int) ([]*store.Message, error) {
	return f.get().LookupRetained(ctx, tenant, filter, limit)
}

func (f *Follower) TenantUsage(ctx context.Context, tenant string) (store.TenantUsage, error) {
	return f.get().TenantUsage(ctx, tenant)
}
