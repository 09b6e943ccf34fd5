package redisstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
)

var k = store.SessionKey{Tenant: "acme", ClientID: "c"}

// With its replicas gone, the primary refuses writes (min-replicas-to-write)
// or WAIT reports too few copies: either way nothing is acknowledged.
func TestRedisStore_NoReplicaNoAck(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g := redistest.StartGroup(t, 1, 1)
	s, err := New(Config{Addr: g.Primary.Addr, MinReplicas: 1, WaitTimeout: 200 * time.Millisecond}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	ctx := context.Background()
	require.NoError(t, s.Activate(ctx, k, store.Fence{Epoch: 1}))
	g.Replicas[0].Kill()
	require.Eventually(t, func() bool {
		err := s.PutSubscription(ctx, k, store.Fence{Epoch: 1}, store.Subscription{Filter: "x"})
		return err != nil
	}, 10*time.Second, 50*time.Millisecond)
	err = s.PutSubscription(ctx, k, store.Fence{Epoch: 1}, store.Subscription{Filter: "y"})
	require.ErrorIs(t, err, store.ErrNotReplicated)
}

// primaryStore starts a primary with one replica and a store writing to
// the primary, waiting for one replica.
func primaryStore(t *testing.T) (*redistest.Group, *Store) {
	t.Helper()
	g := redistest.StartGroup(t, 1, 1)
	s, err := New(Config{Addr: g.Primary.Addr, MinReplicas: 1}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return g, s
}

// A writer that follows an old group record is refused once the group's
// record epoch moved on (after a failover).
func TestRedisStore_GroupEpochFence(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g, s := primaryStore(t)
	ctx := context.Background()
	require.NoError(t, s.Activate(ctx, k, store.Fence{Epoch: 1, GroupEpoch: 1}))
	require.NoError(t, g.Primary.Client().Set(ctx, "keel:group-epoch", 2, 0).Err())
	require.ErrorIs(t, s.PutSubscription(ctx, k, store.Fence{Epoch: 1, GroupEpoch: 1}, store.Subscription{Filter: "x"}), store.ErrGroupFenced)
	require.NoError(t, s.PutSubscription(ctx, k, store.Fence{Epoch: 1, GroupEpoch: 2}, store.Subscription{Filter: "x"}))
}

// Retained writes are fenced by the group record epoch as session writes
// are: a writer of an older record is refused (QoS 0 as QoS 1), changes
// nothing and leaves no write mark; under the new record it writes again.
func TestRedisStore_GroupEpochFenceRetained(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g, s := primaryStore(t)
	ctx := context.Background()
	s.SetGroupEpoch(1)
	changed, err := s.PutRetained(ctx, "acme", &store.Message{ID: "r/1", Topic: "a/b", Payload: []byte("one"), QoS: 1, Created: 1})
	require.NoError(t, err)
	require.True(t, changed)
	primary := g.Primary.Client()
	require.NoError(t, primary.Set(ctx, "keel:group-epoch", 2, 0).Err())
	marks := func() []any {
		v, err := primary.MGet(ctx, WriteEpochKey, WriteSeqKey).Result()
		require.NoError(t, err)
		return v
	}
	before := marks()
	for _, m := range []*store.Message{
		{ID: "r/2", Topic: "a/b", Payload: []byte("two"), QoS: 1, Created: 2},
		{ID: "r/3", Topic: "a/b", Payload: []byte("three"), QoS: 0, Created: 3},
		{ID: "r/4", Topic: "a/b", QoS: 1, Created: 4}, // a clear
		{ID: "r/5", Topic: "a/c", Payload: []byte("new topic"), QoS: 1, Created: 5},
	} {
		_, err := s.PutRetained(ctx, "acme", m)
		require.ErrorIs(t, err, store.ErrGroupFenced, m.ID)
	}
	require.Equal(t, before, marks(), "a refused call leaves no mark")
	got, err := s.LookupRetained(ctx, "acme", "#", 10)
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.Equal(t, "one", string(got[0].Payload))

	s.SetGroupEpoch(2)
	changed, err = s.PutRetained(ctx, "acme", &store.Message{ID: "r/6", Topic: "a/b", Payload: []byte("six"), QoS: 1, Created: 6})
	require.NoError(t, err)
	require.True(t, changed)
	got, err = s.LookupRetained(ctx, "acme", "a/b", 10)
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.Equal(t, "six", string(got[0].Payload))
}

// A write that reaches a replica (a primary demoted by a failover or
// switchover, before the writer follows the new record) is refused with
// READONLY, which is the retryable ErrUnavailable, never a success.
func TestRedisStore_ReplicaRefusesAsUnavailable(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g := redistest.StartGroup(t, 1, 1)
	s, err := New(Config{Addr: g.Replicas[0].Addr, MinReplicas: 1, WaitTimeout: 200 * time.Millisecond}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	err = s.Activate(context.Background(), k, store.Fence{Epoch: 1})
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorContains(t, err, "READONLY")
}

// BenchmarkRedisStore_Append measures acknowledged records per second
// (appended, replicated to one of two replicas, WAIT 1) at a batch size,
// and as a share of SET on the same primary (x-set; see
// BenchmarkRedisStore_WriteFloor for what the format allows);
// "-took" marks every entry a QoS 2 delivery to remember (TookQoS2), past
// the list's bound from the first thousand records on.
func BenchmarkRedisStore_Append(b *testing.B) {
	g := redistest.StartGroup(b, 2, 1)
	for _, bc := range []struct {
		batch int
		took  bool
	}{{1, false}, {32, false}, {32, true}} {
		batch := bc.batch
		name := fmt.Sprintf("batch=%d", batch)
		if bc.took {
			name += "-took"
		}
		b.Run(name, func(b *testing.B) {
			s, err := New(Config{Addr: g.Primary.Addr, MinReplicas: 1}, nil)
			require.NoError(b, err)
			defer s.Close()
			ctx := context.Background()
			// Each run starts empty: the msgIDs of an earlier run (or of
			// the framework's first, one-record run) would be duplicates.
			require.NoError(b, g.Primary.Client().FlushAll(ctx).Err())
			f := store.Fence{Epoch: 1}
			const writers = 16
			keys := make([]store.SessionKey, writers)
			for i := range keys {
				keys[i] = store.SessionKey{Tenant: "bench", ClientID: fmt.Sprint(i)}
				require.NoError(b, s.Activate(ctx, keys[i], f))
			}
			payload := make([]byte, 64)
			set := g.Primary.SetRate(b)
			b.ResetTimer()
			start, cpu0, script0 := time.Now(), g.CPU(), g.Primary.CommandTime("evalsha")
			list0 := g.Primary.CommandTime("rpush") + g.Primary.CommandTime("ltrim")
			done := make(chan error, writers)
			per := b.N/writers + 1
			for w := range writers {
				go func(w int) {
					for i := 0; i < per; i += batch {
						es := make([]store.Entry, 0, batch)
						ms := make([]*store.Message, 0, batch)
						for j := 0; j < batch; j++ {
							id := fmt.Sprintf("%d/%d", w, i+j)
							e := store.Entry{MsgID: id, QoS: 1}
							if bc.took {
								e.QoS, e.TookQoS2 = 2, true
							}
							es = append(es, e)
							ms = append(ms, &store.Message{ID: id, Topic: "t", Payload: payload, QoS: 1})
						}
						if _, err := s.Append(ctx, keys[w], f, store.QueueLimits{}, es, ms); err != nil {
							done <- err
							return
						}
					}
					done <- nil
				}(w)
			}
			for range writers {
				require.NoError(b, <-done)
			}
			rate := float64(per*writers) / time.Since(start).Seconds()
			b.ReportMetric(rate, "records/s")
			if set > 0 {
				b.ReportMetric(rate/set, "x-set")
			}
			b.ReportMetric(float64((g.CPU()-cpu0).Microseconds())/float64(per*writers), "redis-cpu-us/record")
			b.ReportMetric(float64((g.Primary.CommandTime("evalsha")-script0).Nanoseconds())/1e3/float64(per*writers), "script-us/record")
			if bc.took {
				// The list's own commands, within the script's time.
				list := g.Primary.CommandTime("rpush") + g.Primary.CommandTime("ltrim") - list0
				b.ReportMetric(float64(list.Nanoseconds())/1e3/float64(per*writers), "took-list-us/record")
			}
		})
	}
}

// A stored message's body lives as long as a session refers to it when the
// message has no MQTT expiry (a session may stay offline for as long as
// its own expiry interval allows), and with one goes a minute after it at
// the latest. Bodies share a bucket, a hundred messages of an ingress edge
// to one (BodyKey), those that expire apart from those that do not: a
// bucket of expiring bodies expires with the last of them. A body shared
// by two sessions counts its references; a bucket goes with its last body.
func TestRedisStore_BodyExpiryFollowsTheMessage(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g, s := primaryStore(t)
	ctx := context.Background()
	f := store.Fence{Epoch: 1}
	other := store.SessionKey{Tenant: "acme", ClientID: "d"}
	for _, sk := range []store.SessionKey{k, other} {
		require.NoError(t, s.Activate(ctx, sk, f))
	}
	now := time.Now().Unix()
	msg := func(seq int, expiry int64) *store.Message {
		return &store.Message{ID: fmt.Sprintf("edge-a/1/%d", seq), Topic: "t", Payload: []byte("x"), QoS: 1, Created: int64(seq), Expiry: expiry}
	}
	add := func(sk store.SessionKey, ms ...*store.Message) {
		t.Helper()
		var es []store.Entry
		for _, m := range ms {
			es = append(es, store.Entry{MsgID: m.ID, QoS: 1})
		}
		res, err := s.Append(ctx, sk, f, store.QueueLimits{}, es, ms)
		require.NoError(t, err)
		require.Equal(t, len(ms), res.Added)
	}
	c := g.Primary.Client()
	expireAt := func(c *redis.Client, key string) int64 {
		t.Helper()
		at, err := c.ExpireTime(ctx, key).Result()
		require.NoError(t, err)
		if at < 0 {
			return int64(at) // -1: none, -2: no key
		}
		return int64(at / time.Second)
	}
	grace := int64(bodyExpiry / time.Second)
	a, later, sooner, forever := msg(101, now+100), msg(102, now+200), msg(103, now+50), msg(104, 0)
	expiringKey, field := BodyKey(a.ID, true)
	foreverKey, _ := BodyKey(forever.ID, false)
	require.Equal(t, "mx:edge-a/1/1", expiringKey)
	require.Equal(t, "mb:edge-a/1/1", foreverKey)
	add(k, a)
	require.Equal(t, now+100+grace, expireAt(c, expiringKey), "a bucket of expiring bodies expires with them")
	add(k, later, sooner)
	require.Equal(t, now+200+grace, expireAt(c, expiringKey), "... with the last of them")
	add(other, a)
	require.Equal(t, now+200+grace, expireAt(c, expiringKey), "a second reference stores nothing")
	add(k, forever)
	require.Equal(t, int64(-1), expireAt(c, foreverKey), "a body that never expires has a bucket of its own, which does not")
	require.Equal(t, now+200+grace, expireAt(c, expiringKey))
	// Replicas hold the same: they apply the script's effects.
	require.Equal(t, now+200+grace, expireAt(g.Replicas[0].Client(), expiringKey))
	require.Equal(t, "2", c.HGet(ctx, expiringKey, "#"+field).Val(), "one reference per session")
	_, laterField := BodyKey(later.ID, true)
	require.Empty(t, c.HGet(ctx, expiringKey, "#"+laterField).Val(), "one reference: no count")
	st, err := s.Load(ctx, k)
	require.NoError(t, err)
	require.Len(t, st.Messages, 4)
	require.Equal(t, a, st.Messages[a.ID])
	require.Equal(t, forever, st.Messages[forever.ID])

	// In flight, they stay where they are; every reference released, the
	// buckets go.
	require.NoError(t, s.Send(ctx, k, f, []store.Entry{{MsgID: a.ID, QoS: 2, PacketID: 1}, {MsgID: forever.ID, QoS: 1, PacketID: 2}}))
	require.NoError(t, s.Pubrel(ctx, k, f, 1))
	st, err = s.Load(ctx, k)
	require.NoError(t, err)
	require.Len(t, st.Inflight, 2)
	require.Len(t, st.Messages, 4, "a PUBREC received keeps an entry's message where it is")
	require.NoError(t, s.Complete(ctx, k, f, []uint16{1, 2}))
	require.NoError(t, s.Dequeue(ctx, k, f, []string{later.ID, sooner.ID}))
	require.Equal(t, int64(1), c.Exists(ctx, expiringKey).Val(), "the other session still holds one")
	require.Empty(t, c.HGet(ctx, expiringKey, "#"+field).Val())
	require.Zero(t, c.Exists(ctx, foreverKey).Val())
	require.NoError(t, s.DeleteSession(ctx, other, f))
	require.Zero(t, c.Exists(ctx, expiringKey).Val())
}

// Above the high-water mark of maxmemory, appends and retained writes are
// refused (ErrFull: not acknowledged) while every other write goes on, so
// that sessions drain what they hold; below it again, appends are taken.
// Nothing refused was stored, and everything taken before is there.
func TestRedisStore_HighWaterMark(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g := redistest.StartGroup(t, 1, 1)
	ctx := context.Background()
	c := g.Primary.Client()
	used, _ := parseMemory(c.Info(ctx, "memory").Val())
	limit := used + 4<<20
	require.NoError(t, c.ConfigSet(ctx, "maxmemory", fmt.Sprint(limit)).Err())
	require.NoError(t, c.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err())
	var seen struct {
		mu   sync.Mutex
		full bool
	}
	s, err := New(Config{Addr: g.Primary.Addr, MinReplicas: 1, HighWater: 0.8, MemoryCheck: 20 * time.Millisecond,
		MemoryObserver: func(_, _ int64, full bool) { seen.mu.Lock(); seen.full = full; seen.mu.Unlock() }}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	f := store.Fence{Epoch: 1}
	require.NoError(t, s.Activate(ctx, k, f))

	payload := make([]byte, 64<<10)
	var taken []string
	for i := 0; ; i++ {
		require.Less(t, i, 200, "never above the mark")
		id := fmt.Sprintf("e/1/%d", i)
		_, err := s.Append(ctx, k, f, store.QueueLimits{}, []store.Entry{{MsgID: id, QoS: 1}},
			[]*store.Message{{ID: id, Topic: "t", Payload: payload, QoS: 1}})
		if errors.Is(err, ErrFull) {
			break
		}
		require.NoError(t, err)
		taken = append(taken, id)
		time.Sleep(25 * time.Millisecond) // a memory check between appends
	}
	require.True(t, s.Full())
	seen.mu.Lock()
	require.True(t, seen.full, "the observer heard it")
	seen.mu.Unlock()
	_, err = s.PutRetained(ctx, "acme", &store.Message{ID: "r/1", Topic: "kept", Payload: payload, QoS: 1, Created: 1})
	require.ErrorIs(t, err, ErrFull)
	_, err = s.PutRetained(ctx, "acme", &store.Message{ID: "r/2", Topic: "kept", QoS: 1, Created: 2})
	require.NoError(t, err, "clearing a retained message is taken")

	st, err := s.Load(ctx, k)
	require.NoError(t, err)
	require.Len(t, st.Queue, len(taken), "everything taken is stored, nothing refused is")
	// Draining goes on above the mark: dequeue half of the queue.
	require.NoError(t, s.Dequeue(ctx, k, f, taken[:len(taken)/2+1]))
	testutil.Eventually(t, 5*time.Second, func() error {
		if s.Full() {
			return errors.New("still above the mark")
		}
		return nil
	})
	_, err = s.Append(ctx, k, f, store.QueueLimits{}, []store.Entry{{MsgID: "e/1/after", QoS: 1}},
		[]*store.Message{{ID: "e/1/after", Topic: "t", Payload: []byte("x"), QoS: 1}})
	require.NoError(t, err)
}
