// Package redisstore implements the persistence store on one Redis group
// (a primary and its replicas). Every session write runs one Lua script that
// checks the session epoch and the group record epoch, and writes are
// group-committed: a single writer connection sends everything waiting as
// one pipeline of scripts followed by WAIT, on the same connection and
// outside any script (Redis 7 ignores WAIT inside scripts and MULTI).
package redisstore

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// WriteSeqKey and WriteEpochKey say where a node's data stands in its
// group's history. Every write script call that writes (past its fences)
// increments WriteSeqKey and raises WriteEpochKey to the group epoch it
// was admitted under, in the same call, so the marks are exactly as old as
// the data around them: on every node, through replication, the AOF and a
// restart. Writers of one group record write to its primary only, so
// nodes with the same write epoch hold prefixes of one stream, the higher
// count the longer one; a node with a higher write epoch holds writes of a
// later record, whose primary held every acknowledged write when it was
// promoted. Unlike a replication offset (a restarted replica reports 1
// under a new replication ID, whatever it loaded) the pair compares across
// restarts, which is what a failover needs to find the replica holding
// every acknowledged write. A promotion that is never published admits no
// writer (its stamp fences the old record's) and raises neither.
const (
	WriteSeqKey   = "keel:write-seq"
	WriteEpochKey = "keel:write-epoch"
)

// Config configures a Redis store.
type Config struct {
	Addr string
	// MinReplicas is how many replicas must confirm a write (WAIT n); 0 runs
	// unreplicated, which an operator must choose explicitly.
	MinReplicas int
	// WaitTimeout bounds WAIT.
	WaitTimeout time.Duration
	// MaxBatch bounds the writes sent in one pipeline.
	MaxBatch int
	// Lanes is how many commit loops write at once (default DefaultLanes),
	// each on connections of its own; a session's writes, and a retained
	// topic's, always take the same lane.
	Lanes int
	// Dialer, if set, opens the connections to Redis (tests cut them).
	Dialer func(ctx context.Context, network, addr string) (net.Conn, error)
	// HighWater is the share of the primary's maxmemory above which
	// appends and retained writes are refused (ErrFull); default
	// DefaultHighWater. MemoryCheck is how often it is read (default 500
	// ms); MemoryObserver, if set, hears each reading.
	HighWater      float64
	MemoryCheck    time.Duration
	MemoryObserver MemoryObserver
}

// Store is a [store.Store] on Redis.
type Store struct {
	cfg    Config
	rdb    *redis.Client
	logger *slog.Logger

	lanes []chan *op // one per commit loop (see laneOf)
	done  chan struct{}
	wg    sync.WaitGroup
	once  sync.Once

	groupEpoch atomic.Uint64
	full       atomic.Bool // memory above the high-water mark (watchMemory)
	// Observer, if set, hears about every commit (metrics); set before use.
	Observer Observer
}

// Observer hears about commits.
type Observer interface {
	// Committed reports one pipeline: its script calls, how long it took,
	// and whether it waited for replicas and they confirmed in time.
	Committed(calls int, d time.Duration, waited, replicated bool)
}

// ErrUnavailable wraps failures after which the write may be retried.
var ErrUnavailable = errors.New("redis unavailable")

// ErrClosed is returned for operations on a closed store.
var ErrClosed = errors.New("redis store closed")

type op struct {
	script string
	keys   []string
	args   []any
	wait   bool // needs replication before it counts
	// superseded: a retained write a newer one of its topic replaced in
	// the same commit (see merge); it is answered "not changed" once that
	// one is written.
	superseded bool
	result     chan opResult
}

type opResult struct {
	val any
	err error
}

// New connects to the primary and starts the committer.
func New(cfg Config, logger *slog.Logger) (*Store, error) {
	if cfg.WaitTimeout <= 0 {
		cfg.WaitTimeout = time.Second
	}
	if cfg.MaxBatch <= 0 {
		cfg.MaxBatch = 64
	}
	if cfg.HighWater <= 0 || cfg.HighWater > 1 {
		cfg.HighWater = DefaultHighWater
	}
	if cfg.MemoryCheck <= 0 {
		cfg.MemoryCheck = 500 * time.Millisecond
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Lanes <= 0 {
		cfg.Lanes = DefaultLanes
	}
	s := &Store{cfg: cfg, logger: logger, done: make(chan struct{}),
		rdb: redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 8, Dialer: cfg.Dialer})}
	s.wg.Add(cfg.Lanes + 1)
	for range cfg.Lanes {
		ops := make(chan *op, 4096)
		s.lanes = append(s.lanes, ops)
		// A client per lane: go-redis v9.23 races when one client opens
		// its first connections from several goroutines (initConn).
		rdb := redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: commitsInFlight, Dialer: cfg.Dialer})
		go s.commitLoop(ops, rdb)
	}
	go s.watchMemory(cfg.MemoryCheck)
	return s, nil
}

// SetGroupEpoch sets the group record epoch carried by every write.
func (s *Store) SetGroupEpoch(e uint64) { s.groupEpoch.Store(e) }

// GroupEpoch returns the group record epoch set by [Store.SetGroupEpoch].
func (s *Store) GroupEpoch() uint64 { return s.groupEpoch.Load() }

// Addr returns the address of the primary the store writes to.
func (s *Store) Addr() string { return s.cfg.Addr }

// Ping checks that the primary answers.
func (s *Store) Ping(ctx context.Context) error { return s.rdb.Ping(ctx).Err() }

// Close stops the committer and closes the connections.
func (s *Store) Close() error {
	s.once.Do(func() {
		close(s.done)
		s.wg.Wait()
		_ = s.rdb.Close()
	})
	return nil
}

// DefaultLanes is how many commit loops a store runs by default. One loop
// sends a commit and reads its answers before it sends the next, so the
// primary idles while the loop's side of each round trip runs; a few
// loops keep it busy. Writes of different sessions have no order between
// them (DESIGN.md: each session has one writer, and every write is
// answered by itself), so they may take different lanes.
const DefaultLanes = 4

// laneOf is the lane of an op: by its session's key, or for a retained
// write by its tenant and topic, so that a session's writes (and a topic's)
// commit in the order they came.
func (s *Store) laneOf(o *op) chan *op {
	if len(s.lanes) == 1 {
		return s.lanes[0]
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(o.keys[0]))
	if o.script == scriptPutRetained {
		topic, _ := o.args[1].(string)
		_, _ = h.Write([]byte(topic))
	}
	return s.lanes[h.Sum32()%uint32(len(s.lanes))]
}

// commitsInFlight is how many commits may wait for replication at once.
// A commit's WAIT blocks its connection, so each has its own; the next
// commit's scripts run on another while the replicas catch up with the
// last, instead of the primary idling through every WAIT.
const commitsInFlight = 2

// commitLoop is a lane's single writer: it sends every operation waiting
// in ops as one pipeline of scripts, in order, and hands the commit to a
// goroutine that waits for replication (WAIT, on the same connection) and
// answers each op. Answers go out in commit order.
func (s *Store) commitLoop(ops <-chan *op, rdb *redis.Client) {
	defer s.wg.Done()
	defer rdb.Close()
	ctx := context.Background()
	conns := make(chan *redis.Conn, commitsInFlight)
	for range commitsInFlight {
		conns <- nil // opened on first use
	}
	var replicating sync.WaitGroup
	defer func() {
		replicating.Wait()
		for range commitsInFlight {
			if c := <-conns; c != nil {
				_ = c.Close()
			}
		}
	}()
	answered := make(chan struct{})
	close(answered)
	var refusedLogged time.Time
	for {
		var first *op
		select {
		case first = <-ops:
		case <-s.done:
			return
		}
		// A connection frees up as its commit's WAIT returns; meanwhile the
		// batch grows.
		conn := <-conns
		batch := make([]*op, 1, s.cfg.MaxBatch)
		batch[0] = first
	more:
		for len(batch) < s.cfg.MaxBatch {
			select {
			case o := <-ops:
				batch = append(batch, o)
			default:
				break more
			}
		}
		if conn == nil {
			conn = rdb.Conn()
			if err := checkFormat(ctx, conn); err != nil {
				// Nothing of the batch is written: a group of another
				// format is an operator's to resolve, anything else is
				// retried with a new connection.
				if time.Since(refusedLogged) > 10*time.Second {
					refusedLogged = time.Now()
					level := slog.LevelWarn
					if errors.Is(err, ErrFormat) {
						level = slog.LevelError
					}
					s.logger.Log(ctx, level, "redis group refused", "error", err)
				}
				_ = conn.Close()
				conns <- nil
				<-answered // answers leave in commit order
				for _, o := range batch {
					o.result <- opResult{err: err}
				}
				continue
			}
			if err := loadScripts(ctx, conn); err != nil {
				s.logger.Warn("loading scripts failed", "error", err)
			}
		}
		w := s.write(ctx, conn, batch)
		prev, done := answered, make(chan struct{})
		answered = done
		replicating.Add(1)
		go func() {
			defer replicating.Done()
			err := s.finish(ctx, conn, w, prev)
			close(done)
			if err != nil {
				// The connection may be broken: start over with a new one.
				_ = conn.Close()
				conn = nil
			}
			conns <- conn
		}()
	}
}

// scriptCall is one EVALSHA of a commit: one op, or several ops of one
// session merged (see merge).
type scriptCall struct {
	script string
	keys   []string
	args   []any
	wait   bool
	ops    []int  // indexes in the batch, in order (a coalesced retained write's riders after it)
	sends  uint64 // sends seen in the batch when the call was made
}

// Where the per-op arguments start, after the fence (and queue limits).
const (
	appendHead = 5 // epoch gepoch maxLen dropOldest tenantMax
	fenceHead  = 2 // epoch gepoch
)

// merge folds the ops of a batch into script calls: a session's appends
// join into one call, and so do its completes, as long as the fence (and
// queue limits) are the same and no other write of the session comes
// between; so a busy session costs a call or two per commit instead of two
// per message. Redis's cost per call (dispatch, the fence's reads, the
// MULTI/EXEC that wraps a script's effects for replicas) dominates these
// small writes.
//
// A send that delivers only entries the session's open append call queues
// joins that call too (scriptAppend), which then never writes them to the
// queue: a message that reaches an online subscriber goes straight into
// its in-flight set, one write instead of three and their removal. The
// send then closes the call: later appends come after it.
//
// Merging moves an op earlier in the batch. Past other sessions' ops that
// is safe: their keys are disjoint but for the shared message records,
// which appends only reference and completes only release. References
// commute, and so do releases, except against a send of an entry that was
// never queued, which needs its message to exist (scriptSend): a complete
// never moves past a send, and a send joins an append call only when that
// call stores every message it sends. Within the session, an append and a
// complete commute too: they touch the queue and the in-flight set apart,
// and an append carries its message's body, so the record exists after it
// whichever runs first. A send and a complete do not (a packet ID is
// reused): a send never joins an append call that a complete of its session
// followed. Every other write of the session ends the merging.
//
// Retained sets are coalesced per topic: of a topic's sets in one batch
// with no clear of it between, only the newest (the last of those with the
// highest creation time, the one the script would leave) is written, at
// its place in the batch; the others ride on its call, answered "not
// changed" with its error and its replication. (Riders are attached where
// a call is made: retained writes never merge into an open call.) A
// retained topic's writes touch only its tenant's hash field and index
// nodes, which other topics' writes leave consistent in either order, so
// moving one past them is safe.
func merge(batch []*op) []*scriptCall {
	calls := make([]*scriptCall, 0, len(batch))
	sessions := make(map[string]*openCalls, len(batch))
	riders := coalesceRetained(batch)
	var sends uint64
	for i, o := range batch {
		if o.script == scriptSend {
			sends++
		}
		if o.superseded {
			continue
		}
		k := o.keys[0]
		st := sessions[k]
		if st == nil {
			st = &openCalls{}
			sessions[k] = st
		}
		var into **scriptCall
		body := fenceHead
		switch o.script {
		case scriptAppend:
			into, body = &st.append, appendHead
		case scriptComplete:
			into = &st.complete
			st.completed = st.append != nil
		case scriptSend:
			if c := st.append; c != nil && !st.completed && sameArgs(c.args[:fenceHead], o.args[:fenceHead]) && sendsOnly(o.args, c.args[appendHead:]) {
				c.args = append(append(c.args, sendMark), o.args[fenceHead:]...)
				c.wait = true
				c.ops = append(c.ops, i)
				st.append, st.complete = nil, nil
				continue
			}
			st.append, st.complete = nil, nil
		default:
			st.append, st.complete = nil, nil
		}
		if into != nil {
			if c := *into; c != nil && sameArgs(c.args[:body], o.args[:body]) && (o.script == scriptAppend || c.sends == sends) {
				c.args = append(c.args, o.args[body:]...)
				c.wait = c.wait || o.wait
				c.ops = append(c.ops, i)
				continue
			}
		}
		c := &scriptCall{script: o.script, keys: o.keys, args: o.args, wait: o.wait, ops: []int{i}, sends: sends}
		for _, j := range riders[i] {
			c.ops = append(c.ops, j)
			c.wait = c.wait || batch[j].wait
		}
		if into != nil {
			c.args = slices.Clip(o.args) // appended to if merged into: never into the op's own array
			*into = c
		}
		if o.script == scriptAppend {
			st.completed = false
		}
		calls = append(calls, c)
	}
	return calls
}

// coalesceRetained marks every retained set of batch that a later or
// newer set of its (tenant, topic) replaces, with no clear of the topic
// between them, as superseded, and returns the superseded ops' indexes by
// the index of the set that replaces them. Of sets alone the script keeps
// the newest (of equal ones the last), whatever is stored; a clear between
// would make the order matter.
func coalesceRetained(batch []*op) map[int][]int {
	type topicKey struct{ hash, topic string }
	var newest map[topicKey]int
	var riders map[int][]int
	for i, o := range batch {
		if o.script != scriptPutRetained {
			continue
		}
		if newest == nil {
			newest, riders = map[topicKey]int{}, map[int][]int{}
		}
		k := topicKey{o.keys[0], o.args[1].(string)}
		if o.args[4] == "1" {
			// A clear stands alone and ends the topic's group: it leaves
			// nothing stored, and a set after it is stored however old.
			delete(newest, k)
			continue
		}
		w, seen := newest[k]
		if !seen {
			newest[k] = i
			continue
		}
		// The script refuses a write older than the stored one; of equal
		// ones the later stays.
		loser, winner := w, i
		if batch[i].args[3].(int64) < batch[w].args[3].(int64) {
			loser, winner = i, w
		}
		batch[loser].superseded = true
		riders[winner] = append(riders[winner], append(riders[loser], loser)...)
		delete(riders, loser)
		newest[k] = winner
	}
	return riders
}

// bodyExpiry is how long a message's body outlives its MQTT expiry: the
// edges' clocks, which judge the expiry, and Redis's, which removes the
// body, may differ by this much without a session missing a body it would
// still deliver.
const bodyExpiry = time.Minute

// bodyExpireAt is when the body of m may go (unix seconds): a while after
// its MQTT expiry, or never (0) for a message without one, which lives as
// long as a session refers to it.
func bodyExpireAt(m *store.Message) int64 {
	if m.Expiry <= 0 {
		return 0
	}
	return m.Expiry + int64(bodyExpiry/time.Second)
}

// sendMark separates a joined send's quads from the append segments.
const sendMark = "S"

// openCalls are the calls of one session that later ops may join.
type openCalls struct {
	append, complete *scriptCall
	completed        bool // a complete came after the append call opened
}

// sendsOnly reports whether every entry of a send's arguments (fence, then
// (msgID, packetID, entry, qos) quads) is appended by segs, an append
// call's segments (a count, then (msgID, entry, body, expireAt) quads).
// A send closes the call it is checked against, so each call is looked
// through once at most.
func sendsOnly(args []any, segs []any) bool {
	appended := make(map[string]bool)
	for i := 0; i < len(segs); {
		n, _ := segs[i].(int)
		for k := range n {
			id, _ := segs[i+1+4*k].(string)
			appended[id] = true
		}
		i += 1 + 4*n
	}
	for j := fenceHead; j < len(args); j += 4 {
		id, _ := args[j].(string)
		if !appended[id] {
			return false
		}
	}
	return true
}

// sameArgs compares fence and limit arguments: strings and ints only.
func sameArgs(a, b []any) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// written is a commit whose scripts ran (or failed) and whose replication
// is not known yet.
type written struct {
	batch    []*op
	calls    []*scriptCall
	cmds     []*redis.Cmd
	wait     bool // some call needs replication
	start    time.Time
	noscript bool  // the server did not know the scripts: nothing ran
	broken   error // the connection failed
}

// write sends the batch's script calls as one pipeline on conn and reads
// their replies.
func (s *Store) write(ctx context.Context, conn *redis.Conn, batch []*op) *written {
	w := &written{batch: batch, calls: merge(batch), start: time.Now()}
	w.cmds = make([]*redis.Cmd, len(w.calls))
	_, perr := conn.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, c := range w.calls {
			w.cmds[i] = p.EvalSha(ctx, shaOf(c.script), c.keys, c.args...)
			w.wait = w.wait || c.wait
		}
		return nil
	})
	for _, cmd := range w.cmds {
		if err := cmd.Err(); err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			// The script cache was flushed (or this is another server):
			// nothing ran; reconnect, which loads the scripts again.
			w.noscript = true
		}
	}
	if perr != nil && !isScriptErr(perr) {
		w.broken = perr
	}
	return w
}

// finish waits on conn until the writes of w reach the replicas they need
// (WAIT, outside any script), then, once the commit before it answered
// (prev closed), answers every op of w. It returns an error when conn
// should not be used again.
func (s *Store) finish(ctx context.Context, conn *redis.Conn, w *written, prev <-chan struct{}) error {
	replicated := true
	waited := w.wait && s.cfg.MinReplicas > 0 && w.broken == nil
	if waited {
		n, err := conn.Do(ctx, "wait", s.cfg.MinReplicas, s.cfg.WaitTimeout.Milliseconds()).Int64()
		replicated = err == nil && n >= int64(s.cfg.MinReplicas)
		if !replicated {
			s.logger.Warn("writes not replicated in time", "replicas", n, "want", s.cfg.MinReplicas, "error", err)
		}
		if err != nil && !isScriptErr(err) {
			w.broken = err
		}
	}
	if s.Observer != nil {
		s.Observer.Committed(len(w.calls), time.Since(w.start), waited, replicated)
	}
	<-prev
	for i, c := range w.calls {
		val, err := w.cmds[i].Result()
		if err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			err = fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
		segments, _ := val.([]any)
		for seg, j := range c.ops {
			o := w.batch[j]
			v := val
			oerr := err
			if c.script == scriptAppend && err == nil {
				// One result per merged append, in order, then the
				// joined send's: 1, or why it wrote nothing.
				v = nil
				if seg < len(segments) {
					v = segments[seg]
				}
				if o.script == scriptSend {
					if text, ok := v.(string); ok {
						oerr = scriptError(text)
					}
				}
			}
			if o.superseded && oerr == nil {
				v = int64(0)
			}
			if oerr == nil && o.wait && !replicated {
				oerr = store.ErrNotReplicated
			}
			o.result <- opResult{val: v, err: mapErr(oerr)}
		}
	}
	if w.noscript {
		return errors.New("scripts not loaded")
	}
	return w.broken
}

// scriptError is an error a script reports inside its reply.
type scriptError string

func (e scriptError) Error() string { return string(e) }

// RedisError marks it a [redis.Error]: the script ran and refused.
func (scriptError) RedisError() {}

func isScriptErr(err error) bool {
	var re redis.Error
	return errors.As(err, &re)
}

func mapErr(err error) error {
	if err == nil || errors.Is(err, redis.Nil) {
		return nil
	}
	msg := err.Error()
	switch {
	case strings.HasPrefix(msg, "GROUPFENCED"):
		return fmt.Errorf("%w: %s", store.ErrGroupFenced, msg)
	case strings.HasPrefix(msg, "FENCED"):
		return fmt.Errorf("%w: %s", store.ErrFenced, msg)
	case strings.HasPrefix(msg, "NOMSG"):
		return fmt.Errorf("%w: %s", store.ErrInvalid, msg)
	case strings.HasPrefix(msg, "FORMAT"):
		return fmt.Errorf("%w: %w: %s", ErrUnavailable, ErrFormat, msg)
	case strings.HasPrefix(msg, "NOREPLICAS"):
		return fmt.Errorf("%w: %s", store.ErrNotReplicated, msg)
	case strings.HasPrefix(msg, "READONLY"), strings.HasPrefix(msg, "UNBLOCKED"):
		// The node became a replica (a failover or switchover demoted it):
		// nothing was written; retry once the new record is followed.
		return fmt.Errorf("%w: %s", ErrUnavailable, msg)
	}
	if !isScriptErr(err) && !errors.Is(err, store.ErrNotReplicated) && !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrClosed) {
		// The connection failed (EOF, reset, timeout: the node went away
		// or demoted itself and dropped its clients): the write may or
		// may not have been applied; every write is idempotent, so it is
		// retried.
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return err
}

// submit queues o behind every operation submitted before it.
func (s *Store) submit(ctx context.Context, o *op) error {
	o.result = make(chan opResult, 1)
	select {
	case s.laneOf(o) <- o:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-s.done:
		return ErrClosed
	}
}

// await waits for the answer to a submitted operation.
func (s *Store) await(ctx context.Context, o *op) (any, error) {
	select {
	case r := <-o.result:
		return r.val, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.done:
		// The committer may have answered just before stopping.
		select {
		case r := <-o.result:
			return r.val, r.err
		default:
			return nil, ErrClosed
		}
	}
}

func (s *Store) exec(ctx context.Context, so *store.Op) store.OpResult {
	o, err := s.prepare(so)
	if err != nil {
		return store.OpResult{Err: err}
	}
	if err := s.submit(ctx, o); err != nil {
		return store.OpResult{Err: err}
	}
	v, err := s.await(ctx, o)
	return parse(so.Kind, v, err)
}

// Submit implements [store.Batcher]: every op goes into the commit queue in
// order now, so a batch shares pipelines and WAITs with whatever else is
// waiting; wait collects the answers.
func (s *Store) Submit(ctx context.Context, ops []store.Op) (wait func() []store.OpResult) {
	res := make([]store.OpResult, len(ops))
	sent := make([]*op, len(ops))
	for i := range ops {
		o, err := s.prepare(&ops[i])
		if err == nil {
			err = s.submit(ctx, o)
		}
		if err != nil {
			res[i].Err = err
			continue
		}
		sent[i] = o
	}
	return func() []store.OpResult {
		for i, o := range sent {
			if o == nil {
				continue
			}
			v, err := s.await(ctx, o)
			res[i] = parse(ops[i].Kind, v, err)
		}
		return res
	}
}

func parse(kind store.OpKind, v any, err error) store.OpResult {
	r := store.OpResult{Err: err}
	if err != nil {
		return r
	}
	switch kind {
	case store.OpAppend:
		if xs, ok := v.([]any); ok && len(xs) == 4 {
			r.Append = store.AppendResult{Added: toInt(xs[0]), Duplicates: toInt(xs[1]), DroppedOldest: toInt(xs[2]), Refused: toInt(xs[3])}
		}
	case store.OpPutRetained:
		n, _ := v.(int64)
		r.Changed = n == 1
	}
	return r
}

// keys are a session's keys, and tq its tenant's count of queued entries
// (outside the hash tag: Redis Cluster is not used).
type keys struct{ s, sub, ql, qe, inf, in, took, tq string }

func keysOf(k store.SessionKey) keys {
	t := k.Tag()
	return keys{s: t + ":s", sub: t + ":sub", ql: t + ":ql", qe: t + ":qe", inf: t + ":inf", in: t + ":in", took: t + ":took", tq: tenantQueuedKey(k.Tenant)}
}

func (s *Store) fenceArgs(f store.Fence) []any {
	return []any{strconv.FormatUint(f.Epoch, 10), strconv.FormatUint(max(f.GroupEpoch, s.groupEpoch.Load()), 10)}
}

// prepare validates a write and builds its script call. Writes a client
// can observe wait for replication; acknowledgement deletes (Complete,
// Dequeue, DeleteIncoming, DeleteSession) do not: losing one only means a
// redelivery. Only QoS 1/2 retained writes wait.
func (s *Store) prepare(so *store.Op) (*op, error) {
	k := so.Key
	if so.Kind != store.OpPutRetained {
		if err := k.Validate(); err != nil {
			return nil, err
		}
	}
	if g := s.groupEpoch.Load(); g > 0 && so.Fence.GroupEpoch > g {
		// The caller has seen a newer group record than this store
		// follows: its primary may be a deposed one, whose writes must
		// not carry (and mark) the newer epoch.
		return nil, fmt.Errorf("%w: write under group epoch %d, this instance follows %d", ErrUnavailable, so.Fence.GroupEpoch, g)
	}
	ks := keysOf(k)
	fa := s.fenceArgs(so.Fence)
	o := &op{wait: true}
	switch so.Kind {
	case store.OpActivate:
		o.script, o.keys, o.args = scriptActivate, []string{ks.s}, fa
	case store.OpPutSession:
		b, err := json.Marshal(&so.Session)
		if err != nil {
			return nil, err
		}
		o.script, o.keys, o.args = scriptPutSession, []string{ks.s}, append(fa, b)
	case store.OpDeleteSession:
		o.script, o.keys, o.args, o.wait = scriptDeleteSession, []string{ks.s, ks.sub, ks.ql, ks.qe, ks.inf, ks.in, ks.took, ks.tq}, fa, false
	case store.OpPutSubscription:
		if so.Sub.Filter == "" {
			return nil, fmt.Errorf("%w: empty filter", store.ErrInvalid)
		}
		b, _ := json.Marshal(&so.Sub)
		o.script, o.keys, o.args = scriptPutSub, []string{ks.s, ks.sub}, append(fa, so.Sub.Filter, b)
	case store.OpDeleteSubscription:
		o.script, o.keys, o.args = scriptDelSub, []string{ks.s, ks.sub}, append(fa, so.Filter)
	case store.OpAppend:
		if s.full.Load() {
			return nil, ErrFull
		}
		if len(so.Entries) != len(so.Messages) {
			return nil, fmt.Errorf("%w: %d entries, %d messages", store.ErrInvalid, len(so.Entries), len(so.Messages))
		}
		drop := "0"
		if so.Limits.DropOldest {
			drop = "1"
		}
		args := make([]any, 0, appendHead+1+4*len(so.Entries))
		args = append(args, fa[0], fa[1], so.Limits.MaxLen, drop, so.Limits.TenantMax, len(so.Entries))
		// The entries and bodies of the op share one buffer.
		size := 0
		for i := range so.Entries {
			m := so.Messages[i]
			if m == nil || m.ID != so.Entries[i].MsgID {
				return nil, fmt.Errorf("%w: entry %d: message ID mismatch", store.ErrInvalid, i)
			}
			if err := validMsgID(m.ID); err != nil {
				return nil, err
			}
			size += bodySize(m) + entrySize(&so.Entries[i])
		}
		buf := make([]byte, 0, size)
		for i := range so.Entries {
			e, m := &so.Entries[i], so.Messages[i]
			at := len(buf)
			if e.TookQoS2 {
				buf = append(buf, tookMark)
			}
			buf = appendEntryTail(buf, e, false)
			eb := buf[at:len(buf):len(buf)]
			at = len(buf)
			buf = appendBody(buf, m)
			args = append(args, e.MsgID, eb, buf[at:len(buf):len(buf)], bodyExpireAt(m))
		}
		o.script, o.keys, o.args = scriptAppend, []string{ks.s, ks.ql, ks.qe, ks.inf, ks.took, ks.tq}, args
	case store.OpSend:
		args := make([]any, 0, fenceHead+4*len(so.Entries))
		args = append(args, fa...)
		for i := range so.Entries {
			e := &so.Entries[i]
			if err := validMsgID(e.MsgID); err != nil {
				return nil, err
			}
			args = append(args, e.MsgID, strconv.Itoa(int(e.PacketID)), appendEntryJSON(nil, e, true), strconv.Itoa(int(e.QoS)))
		}
		o.script, o.keys, o.args = scriptSend, []string{ks.s, ks.ql, ks.qe, ks.inf, ks.tq}, args
	case store.OpPubrel:
		o.script, o.keys, o.args = scriptPubrel, []string{ks.s, ks.inf}, append(fa, strconv.Itoa(int(so.PacketID)))
	case store.OpComplete:
		args := fa
		for _, p := range so.PacketIDs {
			args = append(args, strconv.Itoa(int(p)))
		}
		o.script, o.keys, o.args, o.wait = scriptComplete, []string{ks.s, ks.inf}, args, false
	case store.OpDequeue:
		args := fa
		for _, id := range so.MsgIDs {
			args = append(args, id)
		}
		o.script, o.keys, o.args, o.wait = scriptDequeue, []string{ks.s, ks.ql, ks.qe, ks.tq}, args, false
	case store.OpPutIncoming:
		o.script, o.keys, o.args = scriptPutIncoming, []string{ks.s, ks.in}, append(fa, strconv.Itoa(int(so.Incoming.PacketID)), so.Incoming.MsgID)
	case store.OpDeleteIncoming:
		// Behind the PUBCOMP: a record that came back after a failover
		// would make the client's next QoS 2 PUBLISH under this packet ID
		// look like a resend of the completed one, answered and dropped.
		o.script, o.keys, o.args = scriptDelIncoming, []string{ks.s, ks.in}, append(fa, strconv.Itoa(int(so.PacketID)))
	case store.OpPutRetained:
		m := so.Retained
		if so.Tenant == "" || m == nil || m.Topic == "" {
			return nil, fmt.Errorf("%w: tenant and topic are required", store.ErrInvalid)
		}
		if len(m.Payload) > 0 && s.full.Load() {
			return nil, ErrFull // clearing one frees memory, and is taken
		}
		b, _ := json.Marshal(m)
		empty := "0"
		if len(m.Payload) == 0 {
			empty = "1"
		}
		// The last argument marks the write under the store's group
		// epoch: a new primary that takes only retained writes must still
		// rank above the old record's lineage in a failover.
		o.script, o.keys, o.args, o.wait = scriptPutRetained, []string{retainedKey(so.Tenant)},
			[]any{so.Tenant, m.Topic, b, m.Created, empty, strconv.FormatUint(s.groupEpoch.Load(), 10)}, m.QoS > 0
	default:
		return nil, fmt.Errorf("%w: unknown op kind %d", store.ErrInvalid, so.Kind)
	}
	return o, nil
}

// Activate implements [store.Store].
func (s *Store) Activate(ctx context.Context, k store.SessionKey, f store.Fence) error {
	return s.exec(ctx, &store.Op{Kind: store.OpActivate, Key: k, Fence: f}).Err
}

// PutSession implements [store.Store].
func (s *Store) PutSession(ctx context.Context, k store.SessionKey, f store.Fence, rec store.Session) error {
	return s.exec(ctx, &store.Op{Kind: store.OpPutSession, Key: k, Fence: f, Session: rec}).Err
}

// DeleteSession implements [store.Store].
func (s *Store) DeleteSession(ctx context.Context, k store.SessionKey, f store.Fence) error {
	return s.exec(ctx, &store.Op{Kind: store.OpDeleteSession, Key: k, Fence: f}).Err
}

// PutSubscription implements [store.Store].
func (s *Store) PutSubscription(ctx context.Context, k store.SessionKey, f store.Fence, sub store.Subscription) error {
	return s.exec(ctx, &store.Op{Kind: store.OpPutSubscription, Key: k, Fence: f, Sub: sub}).Err
}

// DeleteSubscription implements [store.Store].
func (s *Store) DeleteSubscription(ctx context.Context, k store.SessionKey, f store.Fence, filter string) error {
	return s.exec(ctx, &store.Op{Kind: store.OpDeleteSubscription, Key: k, Fence: f, Filter: filter}).Err
}

// Append implements [store.Store].
func (s *Store) Append(ctx context.Context, k store.SessionKey, f store.Fence, lim store.QueueLimits, entries []store.Entry, msgs []*store.Message) (store.AppendResult, error) {
	r := s.exec(ctx, &store.Op{Kind: store.OpAppend, Key: k, Fence: f, Limits: lim, Entries: entries, Messages: msgs})
	return r.Append, r.Err
}

func toInt(v any) int {
	n, _ := v.(int64)
	return int(n)
}

// Send implements [store.Store].
func (s *Store) Send(ctx context.Context, k store.SessionKey, f store.Fence, entries []store.Entry) error {
	return s.exec(ctx, &store.Op{Kind: store.OpSend, Key: k, Fence: f, Entries: entries}).Err
}

// Pubrel implements [store.Store].
func (s *Store) Pubrel(ctx context.Context, k store.SessionKey, f store.Fence, packetID uint16) error {
	return s.exec(ctx, &store.Op{Kind: store.OpPubrel, Key: k, Fence: f, PacketID: packetID}).Err
}

// Complete implements [store.Store]. It does not wait for replication.
func (s *Store) Complete(ctx context.Context, k store.SessionKey, f store.Fence, packetIDs []uint16) error {
	return s.exec(ctx, &store.Op{Kind: store.OpComplete, Key: k, Fence: f, PacketIDs: packetIDs}).Err
}

// Dequeue implements [store.Store]. It does not wait for replication.
func (s *Store) Dequeue(ctx context.Context, k store.SessionKey, f store.Fence, msgIDs []string) error {
	return s.exec(ctx, &store.Op{Kind: store.OpDequeue, Key: k, Fence: f, MsgIDs: msgIDs}).Err
}

// PutIncoming implements [store.Store].
func (s *Store) PutIncoming(ctx context.Context, k store.SessionKey, f store.Fence, in store.Incoming) error {
	return s.exec(ctx, &store.Op{Kind: store.OpPutIncoming, Key: k, Fence: f, Incoming: in}).Err
}

// DeleteIncoming implements [store.Store]. It does not wait for replication.
func (s *Store) DeleteIncoming(ctx context.Context, k store.SessionKey, f store.Fence, packetID uint16) error {
	return s.exec(ctx, &store.Op{Kind: store.OpDeleteIncoming, Key: k, Fence: f, PacketID: packetID}).Err
}

// Load implements [store.Store].
func (s *Store) Load(ctx context.Context, k store.SessionKey) (*store.State, error) {
	if err := k.Validate(); err != nil {
		return nil, err
	}
	ks := keysOf(k)
	v, err := s.rdb.Eval(ctx, scriptLoad, []string{ks.s, ks.sub, ks.ql, ks.qe, ks.inf, ks.in, ks.took}).Result()
	if err != nil {
		return nil, mapErr(err)
	}
	xs, ok := v.([]any)
	if !ok || len(xs) != 9 {
		return nil, fmt.Errorf("load: unexpected reply %T", v)
	}
	st := &store.State{Messages: map[string]*store.Message{}}
	st.Epoch, _ = strconv.ParseUint(fmt.Sprint(xs[0]), 10, 64)
	if rec, _ := xs[1].(string); rec != "" {
		st.Session = &store.Session{}
		if err := json.Unmarshal([]byte(rec), st.Session); err != nil {
			return nil, err
		}
	}
	for _, raw := range strs(xs[2]) {
		var sub store.Subscription
		if err := json.Unmarshal([]byte(raw), &sub); err != nil {
			return nil, err
		}
		st.Subs = append(st.Subs, sub)
	}
	if st.Queue, err = queueInOrder(strs(xs[3]), strs(xs[4])); err != nil {
		return nil, err
	}
	inflight := strs(xs[5])
	st.Inflight = make([]store.Entry, len(inflight))
	for i, raw := range inflight {
		if err := parseEntryJSON([]byte(raw), &st.Inflight[i]); err != nil {
			return nil, err
		}
	}
	if len(st.Inflight) == 0 {
		st.Inflight = nil
	}
	inc := strs(xs[6])
	for i := 0; i+1 < len(inc); i += 2 {
		pk, _ := strconv.Atoi(inc[i])
		st.Incoming = append(st.Incoming, store.Incoming{PacketID: uint16(pk), MsgID: inc[i+1]})
	}
	for _, raw := range strs(xs[7]) {
		m, err := parseBody([]byte(raw))
		if err != nil {
			return nil, err
		}
		st.Messages[m.ID] = m
	}
	if took := strs(xs[8]); len(took) > 0 {
		st.TookQoS2 = took
	}
	return st, nil
}

// queueInOrder puts a session's queue entries (qe's field-value pairs) in
// the order of its list's items ("<seq>:<msgID>"): an item names the entry
// of its msgID only while that entry holds its position, for an entry
// that left the queue leaves its item behind (see the scripts' trimQueue),
// and an entry appended again later gets another. Entries no item names
// (none should be) follow, by position.
func queueInOrder(items, qe []string) ([]store.Entry, error) {
	byID := make(map[string]*store.Entry, len(qe)/2)
	entries := make([]store.Entry, len(qe)/2)
	for i := 0; i+1 < len(qe); i += 2 {
		e := &entries[i/2]
		if err := parseEntryJSON([]byte(qe[i+1]), e); err != nil {
			return nil, err
		}
		byID[qe[i]] = e
	}
	out := make([]store.Entry, 0, len(entries))
	for _, item := range items {
		seq, id, ok := strings.Cut(item, ":")
		if !ok {
			continue
		}
		e := byID[id]
		if e == nil || strconv.FormatUint(e.Seq, 10) != seq {
			continue
		}
		out = append(out, *e)
		delete(byID, id)
	}
	if len(byID) > 0 {
		rest := make([]store.Entry, 0, len(byID))
		for _, e := range byID {
			rest = append(rest, *e)
		}
		slices.SortFunc(rest, func(a, b store.Entry) int { return cmp.Compare(a.Seq, b.Seq) })
		out = append(out, rest...)
	}
	return out, nil
}

func strs(v any) []string {
	xs, _ := v.([]any)
	out := make([]string, 0, len(xs))
	for _, x := range xs {
		s, _ := x.(string)
		out = append(out, s)
	}
	return out
}

func retainedKey(tenant string) string { return "r:" + tenant }

// tenantQueuedKey counts the entries queued for the tenant's sessions.
func tenantQueuedKey(tenant string) string { return "tq:" + tenant }

// TenantUsage implements [store.Store]: the tenant's queued count and the
// size of its retained hash, read together.
func (s *Store) TenantUsage(ctx context.Context, tenant string) (store.TenantUsage, error) {
	if tenant == "" {
		return store.TenantUsage{}, fmt.Errorf("%w: tenant is required", store.ErrInvalid)
	}
	var queued *redis.StringCmd
	var retained *redis.IntCmd
	_, err := s.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		queued = p.Get(ctx, tenantQueuedKey(tenant))
		retained = p.HLen(ctx, retainedKey(tenant))
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return store.TenantUsage{}, fmt.Errorf("%w: tenant usage: %v", ErrUnavailable, err)
	}
	q, _ := queued.Int()
	return store.TenantUsage{Queued: max(q, 0), Retained: int(retained.Val())}, nil
}

// PutRetained implements [store.Store]. Only QoS 1/2 retained writes wait
// for replication.
func (s *Store) PutRetained(ctx context.Context, tenant string, m *store.Message) (bool, error) {
	r := s.exec(ctx, &store.Op{Kind: store.OpPutRetained, Tenant: tenant, Retained: m})
	return r.Changed, r.Err
}

// LookupRetained implements [store.Store].
func (s *Store) LookupRetained(ctx context.Context, tenant, filter string, limit int) ([]*store.Message, error) {
	if tenant == "" || filter == "" {
		return nil, fmt.Errorf("%w: tenant and filter are required", store.ErrInvalid)
	}
	if limit <= 0 {
		limit = 1000
	}
	v, err := s.rdb.Eval(ctx, scriptLookupRetained, []string{retainedKey(tenant)}, tenant, filter, limit).Result()
	if err != nil {
		return nil, mapErr(err)
	}
	now := time.Now().Unix()
	var out []*store.Message
	for _, raw := range strs(v) {
		var m store.Message
		if err := json.Unmarshal([]byte(raw), &m); err != nil {
			return nil, err
		}
		if m.Expiry != 0 && m.Expiry <= now {
			continue
		}
		out = append(out, &m)
	}
	return out, nil
}
