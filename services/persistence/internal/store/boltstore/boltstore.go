// Package boltstore implements the persistence store on a local bbolt file,
// for a single-node Keel (`make run`). It keeps the same contract as the
// Redis store; there is nothing to replicate, so every write is durable once
// its transaction commits.
//
// Writes are group-committed: one goroutine applies every op waiting in one
// bbolt transaction, so they share its fsync, while the ops arriving
// meanwhile wait for the next. Ops apply in the order submitted, and each
// one is all or nothing: one that is refused (fenced, invalid) or fails
// leaves none of its writes and does not fail the others (see
// [Store.Submit]).
package boltstore

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// ErrClosed is returned for writes to a closed store.
var ErrClosed = errors.New("bolt store closed")

// maxBatchRecords bounds the records (see [store.Op.Records]) one
// transaction takes on: a commit stops taking Submit calls once it holds
// that many, so one transaction stays reasonably small. A call is never
// split.
const maxBatchRecords = 4096

// Store is a [store.Store] and a [store.Batcher] on bbolt. Sessions are
// buckets named by their hash tag, holding the sub-buckets below; messages
// and retained messages have buckets of their own.
type Store struct {
	db *bolt.DB

	mu       sync.Mutex
	cond     sync.Cond // signalled when queue grows or closed is set
	queue    []*call   // submitted, not yet taken by the committer
	closed   bool
	loopDone chan struct{}

	closeOnce sync.Once
	closeErr  error

	commits, ops, replays atomic.Uint64

	// Observer, if set, hears about every commit (metrics); set before use.
	Observer Observer

	// failAfterWrite, set by tests before use, makes an op that applied
	// fail as if it had failed after writing: no op of this store can, by
	// construction, but the rollback must work if one ever does.
	failAfterWrite func(*store.Op) error
}

// Observer hears about commits. Its method is that of the Redis store's
// observer, so one implementation serves both.
type Observer interface {
	// Committed reports one batch: its ops and how long applying and
	// committing them took (one transaction, more when an op failed after
	// writing); waited and replicated are always false and true.
	Committed(calls int, d time.Duration, waited, replicated bool)
}

// Stats counts the work of the committer.
type Stats struct {
	Commits uint64 // transactions committed (each one round of writes and fdatasync)
	Ops     uint64 // ops answered by them, refused and failed ones included
	Replays uint64 // transactions rolled back for an op that failed after writing
}

// call is the ops of one Submit, answered together.
type call struct {
	ops  []store.Op
	res  []store.OpResult
	done chan struct{} // closed once res is final
}

var (
	bMsgs     = []byte("msgs")
	bRetained = []byte("retained")
	bSessions = []byte("sessions")
	kEpoch    = []byte("epoch")
	kRec      = []byte("rec")
	kSeq      = []byte("seq")
	subNames  = [][]byte{[]byte("sub"), []byte("q"), []byte("qe"), []byte("inf"), []byte("in")}
	// bTook, in a session's bucket, lists the msgIDs of [store.State.TookQoS2]
	// under the bucket's sequence (8 bytes, big-endian), so a cursor reads
	// them oldest first. It is created by the first append that records one,
	// so sessions that never take a QoS 2 message do not carry it.
	bTook = []byte("took")
	// bTenantQueued holds each tenant's count of queued entries (8 bytes,
	// big-endian), which [store.QueueLimits.TenantMax] is checked against.
	bTenantQueued = []byte("tenant-queued")
)

// Open opens (creating) the store file in dir and starts the committer.
func Open(dir string) (*Store, error) {
	db, err := bolt.Open(filepath.Join(dir, "persistence.db"), 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, err
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bMsgs, bRetained, bSessions, bTenantQueued} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	s := &Store{db: db, loopDone: make(chan struct{})}
	s.cond.L = &s.mu
	go s.commitLoop()
	return s, nil
}

// Close answers every op already submitted, then closes the file. Writes
// submitted afterwards fail with [ErrClosed].
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		s.cond.Broadcast()
		s.mu.Unlock()
		<-s.loopDone
		s.closeErr = s.db.Close()
	})
	return s.closeErr
}

// Stats returns the committer's counts so far.
func (s *Store) Stats() Stats {
	return Stats{Commits: s.commits.Load(), Ops: s.ops.Load(), Replays: s.replays.Load()}
}

// Submit implements [store.Batcher]. The ops join the queue now, behind
// every op submitted before (by Submit or a [store.Store] method), and are
// applied with whatever else is waiting in the committer's next
// transaction; wait returns once that transaction is committed (or ctx
// ends: the ops' outcome is then unknown, as with the Redis store).
//
// Each op is all or nothing and answered on its own: one refused before
// writing (bad input, fenced) just gets its error; one that fails after
// writing part of itself makes the committer roll the transaction back,
// commit the ops before it without it and go on with the ops after it, so
// neither its writes nor its failure reach the ops around it. Only a failed
// commit fails the ops of the transaction with it.
func (s *Store) Submit(ctx context.Context, ops []store.Op) (wait func() []store.OpResult) {
	c := s.submit(ctx, slices.Clone(ops))
	return func() []store.OpResult { return s.await(ctx, c) }
}

func (s *Store) submit(ctx context.Context, ops []store.Op) *call {
	c := &call{ops: ops, res: make([]store.OpResult, len(ops)), done: make(chan struct{})}
	err := ctx.Err()
	if err == nil && len(ops) > 0 {
		s.mu.Lock()
		if s.closed {
			err = ErrClosed
		} else {
			s.queue = append(s.queue, c)
			s.cond.Signal()
		}
		s.mu.Unlock()
		if err == nil {
			return c
		}
	}
	for i := range c.res {
		c.res[i].Err = err
	}
	close(c.done)
	return c
}

func (s *Store) await(ctx context.Context, c *call) []store.OpResult {
	select {
	case <-c.done:
		return c.res
	case <-ctx.Done():
		select {
		case <-c.done: // answered at the same time: the answer is known
			return c.res
		default:
		}
		res := make([]store.OpResult, len(c.ops))
		for i := range res {
			res[i].Err = ctx.Err()
		}
		return res
	}
}

// do applies one op through the queue and waits for it.
func (s *Store) do(ctx context.Context, o store.Op) store.OpResult {
	return s.await(ctx, s.submit(ctx, []store.Op{o}))[0]
}

// commitLoop takes everything queued (up to maxBatchRecords) and commits it
// as one transaction, until the store is closed and the queue drained.
func (s *Store) commitLoop() {
	defer close(s.loopDone)
	var batch []*call
	var ops []slot
	for {
		s.mu.Lock()
		for len(s.queue) == 0 && !s.closed {
			s.cond.Wait()
		}
		if len(s.queue) == 0 {
			s.mu.Unlock()
			return
		}
		n, recs := 0, 0
		for n < len(s.queue) && (n == 0 || recs < maxBatchRecords) {
			for i := range s.queue[n].ops {
				recs += s.queue[n].ops[i].Records()
			}
			n++
		}
		batch = append(batch[:0], s.queue[:n]...)
		rest := copy(s.queue, s.queue[n:])
		clear(s.queue[rest:])
		s.queue = s.queue[:rest]
		s.mu.Unlock()

		ops = ops[:0]
		for _, c := range batch {
			for i := range c.ops {
				ops = append(ops, slot{op: &c.ops[i], res: &c.res[i]})
			}
		}
		start := time.Now()
		for i := 0; i < len(ops); {
			i = s.commit(ops[i:]) + i
		}
		s.ops.Add(uint64(len(ops)))
		if s.Observer != nil {
			s.Observer.Committed(len(ops), time.Since(start), false, true)
		}
		for _, c := range batch {
			close(c.done)
		}
		clear(batch)
		clear(ops)
	}
}

// slot is one op of a batch and where its result goes.
type slot struct {
	op  *store.Op
	res *store.OpResult
}

// errRollback rolls back a transaction in which an op failed after writing.
var errRollback = errors.New("op failed after writing")

// commit applies ops in order in one transaction and commits it, answering
// each, and returns how many it answered: all of them, unless one fails
// after writing part of itself. The transaction is then rolled back and
// the ops before that one applied again in one of their own (bbolt has no
// savepoints), so commit returns after the failed op, and the ops after it
// go into the next transaction: every op is applied at most twice, however
// many fail.
func (s *Store) commit(ops []slot) int {
	failed := -1
	err := s.db.Update(func(tx *bolt.Tx) error {
		for i, o := range ops {
			r, err := apply(tx, o.op)
			if err == nil && r.Err == nil && s.failAfterWrite != nil {
				err = s.failAfterWrite(o.op)
			}
			if err != nil {
				*o.res = store.OpResult{Err: err}
				failed = i
				return errRollback
			}
			*o.res = r
		}
		return nil
	})
	n := len(ops)
	if failed >= 0 {
		s.replays.Add(1)
		n = failed + 1
		ops = ops[:failed]
		err = nil
		if len(ops) > 0 {
			err = s.db.Update(func(tx *bolt.Tx) error {
				for _, o := range ops {
					r, err := apply(tx, o.op)
					if err != nil {
						// It did not the first time, on the same state:
						// this cannot happen; fail them all, not guess.
						return fmt.Errorf("%s failed on second application: %w", o.op.Kind, err)
					}
					*o.res = r
				}
				return nil
			})
		}
	}
	if len(ops) == 0 {
		return n
	}
	if err != nil {
		// Nothing of this transaction is stored.
		err = fmt.Errorf("bolt commit: %w", err)
		for _, o := range ops {
			if o.res.Err == nil {
				*o.res = store.OpResult{Err: err}
			}
		}
		return n
	}
	s.commits.Add(1)
	return n
}

// Activate implements [store.Store].
func (s *Store) Activate(ctx context.Context, k store.SessionKey, f store.Fence) error {
	return s.do(ctx, store.Op{Kind: store.OpActivate, Key: k, Fence: f}).Err
}

// PutSession implements [store.Store].
func (s *Store) PutSession(ctx context.Context, k store.SessionKey, f store.Fence, rec store.Session) error {
	return s.do(ctx, store.Op{Kind: store.OpPutSession, Key: k, Fence: f, Session: rec}).Err
}

// DeleteSession implements [store.Store].
func (s *Store) DeleteSession(ctx context.Context, k store.SessionKey, f store.Fence) error {
	return s.do(ctx, store.Op{Kind: store.OpDeleteSession, Key: k, Fence: f}).Err
}

// PutSubscription implements [store.Store].
func (s *Store) PutSubscription(ctx context.Context, k store.SessionKey, f store.Fence, sub store.Subscription) error {
	return s.do(ctx, store.Op{Kind: store.OpPutSubscription, Key: k, Fence: f, Sub: sub}).Err
}

// DeleteSubscription implements [store.Store].
func (s *Store) DeleteSubscription(ctx context.Context, k store.SessionKey, f store.Fence, filter string) error {
	return s.do(ctx, store.Op{Kind: store.OpDeleteSubscription, Key: k, Fence: f, Filter: filter}).Err
}

// Append implements [store.Store].
func (s *Store) Append(ctx context.Context, k store.SessionKey, f store.Fence, lim store.QueueLimits, entries []store.Entry, msgs []*store.Message) (store.AppendResult, error) {
	r := s.do(ctx, store.Op{Kind: store.OpAppend, Key: k, Fence: f, Limits: lim, Entries: entries, Messages: msgs})
	return r.Append, r.Err
}

// Send implements [store.Store].
func (s *Store) Send(ctx context.Context, k store.SessionKey, f store.Fence, entries []store.Entry) error {
	return s.do(ctx, store.Op{Kind: store.OpSend, Key: k, Fence: f, Entries: entries}).Err
}

// Pubrel implements [store.Store].
func (s *Store) Pubrel(ctx context.Context, k store.SessionKey, f store.Fence, packetID uint16) error {
	return s.do(ctx, store.Op{Kind: store.OpPubrel, Key: k, Fence: f, PacketID: packetID}).Err
}

// Complete implements [store.Store].
func (s *Store) Complete(ctx context.Context, k store.SessionKey, f store.Fence, packetIDs []uint16) error {
	return s.do(ctx, store.Op{Kind: store.OpComplete, Key: k, Fence: f, PacketIDs: packetIDs}).Err
}

// Dequeue implements [store.Store].
func (s *Store) Dequeue(ctx context.Context, k store.SessionKey, f store.Fence, msgIDs []string) error {
	return s.do(ctx, store.Op{Kind: store.OpDequeue, Key: k, Fence: f, MsgIDs: msgIDs}).Err
}

// PutIncoming implements [store.Store].
func (s *Store) PutIncoming(ctx context.Context, k store.SessionKey, f store.Fence, in store.Incoming) error {
	return s.do(ctx, store.Op{Kind: store.OpPutIncoming, Key: k, Fence: f, Incoming: in}).Err
}

// DeleteIncoming implements [store.Store].
func (s *Store) DeleteIncoming(ctx context.Context, k store.SessionKey, f store.Fence, packetID uint16) error {
	return s.do(ctx, store.Op{Kind: store.OpDeleteIncoming, Key: k, Fence: f, PacketID: packetID}).Err
}

// PutRetained implements [store.Store].
func (s *Store) PutRetained(ctx context.Context, tenant string, m *store.Message) (bool, error) {
	r := s.do(ctx, store.Op{Kind: store.OpPutRetained, Tenant: tenant, Retained: m})
	return r.Changed, r.Err
}

// Load implements [store.Store]. It reads committed state only, in a
// read-only transaction: every write answered before it started is seen.
func (s *Store) Load(_ context.Context, k store.SessionKey) (*store.State, error) {
	if err := k.Validate(); err != nil {
		return nil, err
	}
	st := &store.State{Messages: map[string]*store.Message{}}
	err := s.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bSessions).Bucket([]byte(k.Tag()))
		if b == nil {
			return nil
		}
		st.Epoch = u64(b.Get(kEpoch))
		if v := b.Get(kRec); v != nil {
			st.Session = &store.Session{}
			if err := json.Unmarshal(v, st.Session); err != nil {
				return err
			}
		}
		// The sub-buckets are missing after DeleteSession until the next write.
		each := func(name []byte, fn func(k, v []byte) error) error {
			if sb := b.Bucket(name); sb != nil {
				return sb.ForEach(fn)
			}
			return nil
		}
		if err := each(subNames[0], func(_, v []byte) error {
			var sub store.Subscription
			if err := json.Unmarshal(v, &sub); err != nil {
				return err
			}
			st.Subs = append(st.Subs, sub)
			return nil
		}); err != nil {
			return err
		}
		add := func(id string) {
			if _, ok := st.Messages[id]; !ok {
				if m := loadMsg(tx, id); m != nil {
					st.Messages[id] = m
				}
			}
		}
		qe := b.Bucket(subNames[2]) // exists when q does
		if err := each(subNames[1], func(_, id []byte) error {
			var e store.Entry
			if err := json.Unmarshal(qe.Get(id), &e); err != nil {
				return err
			}
			st.Queue = append(st.Queue, e)
			add(e.MsgID)
			return nil
		}); err != nil {
			return err
		}
		if err := each(subNames[3], func(_, v []byte) error {
			var e store.Entry
			if err := json.Unmarshal(v, &e); err != nil {
				return err
			}
			st.Inflight = append(st.Inflight, e)
			add(e.MsgID)
			return nil
		}); err != nil {
			return err
		}
		if err := each(subNames[4], func(k, v []byte) error {
			st.Incoming = append(st.Incoming, store.Incoming{PacketID: binary.BigEndian.Uint16(k), MsgID: string(v)})
			return nil
		}); err != nil {
			return err
		}
		return each(bTook, func(_, v []byte) error {
			st.TookQoS2 = append(st.TookQoS2, string(v))
			return nil
		})
	})
	return st, err
}

// LookupRetained implements [store.Store]. Topics are kept sorted, so the
// scan starts at the filter's literal prefix rather than the whole tenant.
// TenantUsage implements [store.Store].
func (s *Store) TenantUsage(_ context.Context, tenant string) (store.TenantUsage, error) {
	if tenant == "" {
		return store.TenantUsage{}, fmt.Errorf("%w: tenant is required", store.ErrInvalid)
	}
	var u store.TenantUsage
	err := s.db.View(func(tx *bolt.Tx) error {
		u.Queued = tenantQueued(tx, tenant)
		if b := tx.Bucket(bRetained).Bucket([]byte(tenant)); b != nil {
			u.Retained = b.Stats().KeyN
		}
		return nil
	})
	return u, err
}

func (s *Store) LookupRetained(_ context.Context, tenant, filter string, limit int) ([]*store.Message, error) {
	if tenant == "" || filter == "" {
		return nil, fmt.Errorf("%w: tenant and filter are required", store.ErrInvalid)
	}
	if limit <= 0 {
		limit = 1000
	}
	var out []*store.Message
	now := time.Now().Unix()
	err := s.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bRetained).Bucket([]byte(tenant))
		if b == nil {
			return nil
		}
		prefix := literalPrefix(filter)
		c := b.Cursor()
		for k, v := c.Seek([]byte(prefix)); k != nil && strings.HasPrefix(string(k), prefix) && len(out) < limit; k, v = c.Next() {
			if !match(filter, string(k)) {
				continue
			}
			var m store.Message
			if err := json.Unmarshal(v, &m); err != nil {
				return err
			}
			if m.Expiry != 0 && m.Expiry <= now {
				continue
			}
			out = append(out, &m)
		}
		return nil
	})
	sort.SliceStable(out, func(i, j int) bool { return out[i].Topic < out[j].Topic })
	return out, err
}

// literalPrefix is the part of filter before its first wildcard, less the
// separator before it ("a/#" matches "a" as well, [MQTT-4.7.1-2]).
func literalPrefix(filter string) string {
	if i := strings.IndexAny(filter, "+#"); i >= 0 {
		return strings.TrimSuffix(filter[:i], "/")
	}
	return filter
}

// match is MQTT topic matching ([MQTT-4.7]), $-topics excluded from leading
// wildcards.
func match(filter, topic string) bool {
	if strings.HasPrefix(topic, "$") && (strings.HasPrefix(filter, "+") || strings.HasPrefix(filter, "#")) {
		return false
	}
	fs, ts := strings.Split(filter, "/"), strings.Split(topic, "/")
	for i, f := range fs {
		if f == "#" {
			return true
		}
		if i >= len(ts) {
			return false
		}
		if f != "+" && f != ts[i] {
			return false
		}
	}
	return len(fs) == len(ts)
}
