// Package redisstore implements the persistence store on one Redis group
// (a primary and its replicas). Every session write runs one Lua script that
// checks the session epoch and the group record epoch, and writes are
// group-committed: a single writer connection sends everything waiting as
// one pipeline of scripts followed by WAIT, on the same connection and
// outside any script (Redis 7 ignores WAIT inside scripts and MULTI).
package redisstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keelmq/keel/services/persistence/internal/store"
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
	// MessageTTL bounds how long a stored payload lives without expiry set.
	MessageTTL time.Duration
}

// Store is a [store.Store] on Redis.
type Store struct {
	cfg    Config
	rdb    *redis.Client
	logger *slog.Logger

	ops  chan *op
	done chan struct{}
	wg   sync.WaitGroup
	once sync.Once

	groupEpoch uint64
}

type op struct {
	script string
	keys   []string
	args   []any
	wait   bool // needs replication before it counts
	result chan opResult
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
	if cfg.MessageTTL <= 0 {
		cfg.MessageTTL = 7 * 24 * time.Hour
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	s := &Store{cfg: cfg, logger: logger, ops: make(chan *op, 4096), done: make(chan struct{}),
		rdb: redis.NewClient(&redis.Options{Addr: cfg.Addr, PoolSize: 8})}
	s.wg.Add(1)
	go s.commitLoop()
	return s, nil
}

// SetGroupEpoch sets the group record epoch carried by every write.
func (s *Store) SetGroupEpoch(e uint64) { s.groupEpoch = e }

// Close stops the committer and closes the connections.
func (s *Store) Close() error {
	s.once.Do(func() {
		close(s.done)
		s.wg.Wait()
		_ = s.rdb.Close()
	})
	return nil
}

// commitLoop owns the writer connection: it sends every waiting operation
// as one pipeline followed by WAIT, then answers each.
func (s *Store) commitLoop() {
	defer s.wg.Done()
	ctx := context.Background()
	var conn *redis.Conn
	defer func() {
		if conn != nil {
			_ = conn.Close()
		}
	}()
	batch := make([]*op, 0, s.cfg.MaxBatch)
	for {
		select {
		case o := <-s.ops:
			batch = append(batch[:0], o)
		case <-s.done:
			return
		}
	more:
		for len(batch) < s.cfg.MaxBatch {
			select {
			case o := <-s.ops:
				batch = append(batch, o)
			default:
				break more
			}
		}
		if conn == nil {
			conn = s.rdb.Conn()
		}
		if err := s.commit(ctx, conn, batch); err != nil {
			// The connection may be broken: start over with a new one.
			_ = conn.Close()
			conn = nil
		}
	}
}

func (s *Store) commit(ctx context.Context, conn *redis.Conn, batch []*op) error {
	needWait := false
	cmds := make([]*redis.Cmd, len(batch))
	var waitCmd *redis.IntCmd
	_, perr := conn.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, o := range batch {
			cmds[i] = p.Eval(ctx, o.script, o.keys, o.args...)
			needWait = needWait || o.wait
		}
		if needWait && s.cfg.MinReplicas > 0 {
			waitCmd = redis.NewIntCmd(ctx, "wait", s.cfg.MinReplicas, s.cfg.WaitTimeout.Milliseconds())
			_ = p.Process(ctx, waitCmd)
		}
		return nil
	})
	var replicated = true
	if waitCmd != nil {
		n, err := waitCmd.Result()
		replicated = err == nil && n >= int64(s.cfg.MinReplicas)
		if !replicated {
			s.logger.Warn("writes not replicated in time", "replicas", n, "want", s.cfg.MinReplicas, "error", err)
		}
	}
	for i, o := range batch {
		val, err := cmds[i].Result()
		if err == nil && o.wait && !replicated {
			err = store.ErrNotReplicated
		}
		o.result <- opResult{val: val, err: mapErr(err)}
	}
	if perr != nil && !isScriptErr(perr) {
		return perr
	}
	return nil
}

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
	case strings.HasPrefix(msg, "NOREPLICAS"):
		return fmt.Errorf("%w: %s", store.ErrNotReplicated, msg)
	}
	return err
}

func (s *Store) run(ctx context.Context, wait bool, script string, keys []string, args ...any) (any, error) {
	o := &op{script: script, keys: keys, args: args, wait: wait, result: make(chan opResult, 1)}
	select {
	case s.ops <- o:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.done:
		return nil, errors.New("redis store closed")
	}
	select {
	case r := <-o.result:
		return r.val, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

type keys struct{ s, sub, q, qe, inf, in string }

func keysOf(k store.SessionKey) keys {
	t := k.Tag()
	return keys{s: t + ":s", sub: t + ":sub", q: t + ":q", qe: t + ":qe", inf: t + ":inf", in: t + ":in"}
}

func (s *Store) fenceArgs(f store.Fence) []any {
	return []any{strconv.FormatUint(f.Epoch, 10), strconv.FormatUint(max(f.GroupEpoch, s.groupEpoch), 10)}
}

// Activate implements [store.Store].
func (s *Store) Activate(ctx context.Context, k store.SessionKey, f store.Fence) error {
	if err := k.Validate(); err != nil {
		return err
	}
	_, err := s.run(ctx, true, scriptActivate, []string{keysOf(k).s}, s.fenceArgs(f)...)
	return err
}

// PutSession implements [store.Store].
func (s *Store) PutSession(ctx context.Context, k store.SessionKey, f store.Fence, rec store.Session) error {
	if err := k.Validate(); err != nil {
		return err
	}
	b, err := json.Marshal(&rec)
	if err != nil {
		return err
	}
	_, err = s.run(ctx, true, scriptPutSession, []string{keysOf(k).s}, append(s.fenceArgs(f), b)...)
	return err
}

// DeleteSession implements [store.Store].
func (s *Store) DeleteSession(ctx context.Context, k store.SessionKey, f store.Fence) error {
	if err := k.Validate(); err != nil {
		return err
	}
	ks := keysOf(k)
	_, err := s.run(ctx, false, scriptDeleteSession, []string{ks.s, ks.sub, ks.q, ks.qe, ks.inf, ks.in}, s.fenceArgs(f)...)
	return err
}

// PutSubscription implements [store.Store].
func (s *Store) PutSubscription(ctx context.Context, k store.SessionKey, f store.Fence, sub store.Subscription) error {
	if err := k.Validate(); err != nil {
		return err
	}
	if sub.Filter == "" {
		return fmt.Errorf("%w: empty filter", store.ErrInvalid)
	}
	b, _ := json.Marshal(&sub)
	ks := keysOf(k)
	_, err := s.run(ctx, true, scriptPutSub, []string{ks.s, ks.sub}, append(s.fenceArgs(f), sub.Filter, b)...)
	return err
}

// DeleteSubscription implements [store.Store].
func (s *Store) DeleteSubscription(ctx context.Context, k store.SessionKey, f store.Fence, filter string) error {
	if err := k.Validate(); err != nil {
		return err
	}
	ks := keysOf(k)
	_, err := s.run(ctx, true, scriptDelSub, []string{ks.s, ks.sub}, append(s.fenceArgs(f), filter)...)
	return err
}

// Append implements [store.Store].
func (s *Store) Append(ctx context.Context, k store.SessionKey, f store.Fence, lim store.QueueLimits, entries []store.Entry, msgs []*store.Message) (store.AppendResult, error) {
	var res store.AppendResult
	if err := k.Validate(); err != nil {
		return res, err
	}
	if len(entries) != len(msgs) {
		return res, fmt.Errorf("%w: %d entries, %d messages", store.ErrInvalid, len(entries), len(msgs))
	}
	drop := "0"
	if lim.DropOldest {
		drop = "1"
	}
	args := append(s.fenceArgs(f), lim.MaxLen, drop, int(s.cfg.MessageTTL.Seconds()))
	for i, e := range entries {
		m := msgs[i]
		if m == nil || m.ID == "" || m.ID != e.MsgID {
			return res, fmt.Errorf("%w: entry %d: message ID mismatch", store.ErrInvalid, i)
		}
		eb, _ := json.Marshal(&e)
		mb, _ := json.Marshal(m)
		args = append(args, e.MsgID, eb, mb)
	}
	ks := keysOf(k)
	v, err := s.run(ctx, true, scriptAppend, []string{ks.s, ks.q, ks.qe}, args...)
	if err != nil {
		return res, err
	}
	if xs, ok := v.([]any); ok && len(xs) == 4 {
		res.Added, res.Duplicates, res.DroppedOldest, res.Refused = toInt(xs[0]), toInt(xs[1]), toInt(xs[2]), toInt(xs[3])
	}
	return res, nil
}

func toInt(v any) int {
	n, _ := v.(int64)
	return int(n)
}

// Send implements [store.Store].
func (s *Store) Send(ctx context.Context, k store.SessionKey, f store.Fence, entries []store.Entry) error {
	if err := k.Validate(); err != nil {
		return err
	}
	args := s.fenceArgs(f)
	for _, e := range entries {
		eb, _ := json.Marshal(&e)
		args = append(args, e.MsgID, strconv.Itoa(int(e.PacketID)), eb, strconv.Itoa(int(e.QoS)))
	}
	ks := keysOf(k)
	_, err := s.run(ctx, true, scriptSend, []string{ks.s, ks.q, ks.qe, ks.inf}, args...)
	return err
}

// Pubrel implements [store.Store].
func (s *Store) Pubrel(ctx context.Context, k store.SessionKey, f store.Fence, packetID uint16) error {
	ks := keysOf(k)
	_, err := s.run(ctx, true, scriptPubrel, []string{ks.s, ks.inf}, append(s.fenceArgs(f), strconv.Itoa(int(packetID)))...)
	return err
}

// Complete implements [store.Store]. Acknowledgement deletes do not wait
// for replication: losing one only means a redelivery.
func (s *Store) Complete(ctx context.Context, k store.SessionKey, f store.Fence, packetIDs []uint16) error {
	args := s.fenceArgs(f)
	for _, p := range packetIDs {
		args = append(args, strconv.Itoa(int(p)))
	}
	ks := keysOf(k)
	_, err := s.run(ctx, false, scriptComplete, []string{ks.s, ks.inf}, args...)
	return err
}

// Dequeue implements [store.Store].
func (s *Store) Dequeue(ctx context.Context, k store.SessionKey, f store.Fence, msgIDs []string) error {
	args := s.fenceArgs(f)
	for _, id := range msgIDs {
		args = append(args, id)
	}
	ks := keysOf(k)
	_, err := s.run(ctx, false, scriptDequeue, []string{ks.s, ks.q, ks.qe}, args...)
	return err
}

// PutIncoming implements [store.Store].
func (s *Store) PutIncoming(ctx context.Context, k store.SessionKey, f store.Fence, in store.Incoming) error {
	ks := keysOf(k)
	_, err := s.run(ctx, true, scriptPutIncoming, []string{ks.s, ks.in}, append(s.fenceArgs(f), strconv.Itoa(int(in.PacketID)), in.MsgID)...)
	return err
}

// DeleteIncoming implements [store.Store].
func (s *Store) DeleteIncoming(ctx context.Context, k store.SessionKey, f store.Fence, packetID uint16) error {
	ks := keysOf(k)
	_, err := s.run(ctx, false, scriptDelIncoming, []string{ks.s, ks.in}, append(s.fenceArgs(f), strconv.Itoa(int(packetID)))...)
	return err
}

// Load implements [store.Store].
func (s *Store) Load(ctx context.Context, k store.SessionKey) (*store.State, error) {
	if err := k.Validate(); err != nil {
		return nil, err
	}
	ks := keysOf(k)
	v, err := s.rdb.Eval(ctx, scriptLoad, []string{ks.s, ks.sub, ks.q, ks.qe, ks.inf, ks.in}).Result()
	if err != nil {
		return nil, mapErr(err)
	}
	xs, ok := v.([]any)
	if !ok || len(xs) != 7 {
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
	for _, raw := range strs(xs[3]) {
		var e store.Entry
		if err := json.Unmarshal([]byte(raw), &e); err != nil {
			return nil, err
		}
		st.Queue = append(st.Queue, e)
	}
	for _, raw := range strs(xs[4]) {
		var e store.Entry
		if err := json.Unmarshal([]byte(raw), &e); err != nil {
			return nil, err
		}
		st.Inflight = append(st.Inflight, e)
	}
	inc := strs(xs[5])
	for i := 0; i+1 < len(inc); i += 2 {
		pk, _ := strconv.Atoi(inc[i])
		st.Incoming = append(st.Incoming, store.Incoming{PacketID: uint16(pk), MsgID: inc[i+1]})
	}
	for _, raw := range strs(xs[6]) {
		var m store.Message
		if err := json.Unmarshal([]byte(raw), &m); err != nil {
			return nil, err
		}
		st.Messages[m.ID] = &m
	}
	return st, nil
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

// PutRetained implements [store.Store]. Only QoS 1/2 retained writes wait
// for replication.
func (s *Store) PutRetained(ctx context.Context, tenant string, m *store.Message) (bool, error) {
	if tenant == "" || m == nil || m.Topic == "" {
		return false, fmt.Errorf("%w: tenant and topic are required", store.ErrInvalid)
	}
	b, _ := json.Marshal(m)
	empty := "0"
	if len(m.Payload) == 0 {
		empty = "1"
	}
	v, err := s.run(ctx, m.QoS > 0, scriptPutRetained, []string{retainedKey(tenant)}, tenant, m.Topic, b, m.Created, empty)
	if err != nil {
		return false, err
	}
	n, _ := v.(int64)
	return n == 1, nil
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
