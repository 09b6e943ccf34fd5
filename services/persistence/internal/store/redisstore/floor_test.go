package redisstore

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
)

// BenchmarkRedisStore_WriteFloor measures what a store format can reach on
// this machine before any of its logic: scripts that only check the two
// fences, mark the call and write values the client built, 32 records a
// call, on the same group, writers, pipeline and WAIT 1 as
// BenchmarkRedisStore_Append, as a share of SET on the same primary
// (x-set). Its cases are the number of values a record costs:
//
//   - values=3: the queue entry, its order item and the message body,
//     what this store writes per record;
//   - values=2: the entry and the body (a queue without an order list);
//   - values=2-bucketed: the same, a session's entries in hashes of a
//     hundred as the bodies are, small enough for Redis's compact
//     encoding, instead of one hash that grows with the queue;
//   - values=1: the body alone (a session's entries kept elsewhere);
//   - segment: one value for all of a call's records.
//
// Set beside BenchmarkRedisStore_Append's batch=32, it says how much of a
// record's cost is the store's own logic and how much is the number of
// values the format writes.
func BenchmarkRedisStore_WriteFloor(b *testing.B) {
	g := redistest.StartGroup(b, 2, 1)
	// Every script fences and marks as the store's do; KEYS: session,
	// order list, entries, body bucket, entry bucket; ARGV: n, then n (msgID, entry)
	// pairs, n order items, n (field, body) pairs.
	const fenced = `
local g = tonumber(redis.call('GET', 'keel:group-epoch') or '0')
if tonumber(ARGV[1]) < g then return redis.error_reply('GROUPFENCED') end
local cur = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
if tonumber(ARGV[2]) < cur then return redis.error_reply('FENCED') end
redis.call('INCR', '` + WriteSeqKey + `')
local n = tonumber(ARGV[3])
local entries, items, bodies = 4, 4 + 2 * n, 4 + 3 * n
`
	for _, c := range []struct{ name, writes string }{
		{"values=3", `
redis.call('HSET', KEYS[3], unpack(ARGV, entries, items - 1))
redis.call('RPUSH', KEYS[2], unpack(ARGV, items, bodies - 1))
redis.call('HSET', KEYS[4], unpack(ARGV, bodies, #ARGV))`},
		{"values=2", `
redis.call('HSET', KEYS[3], unpack(ARGV, entries, items - 1))
redis.call('HSET', KEYS[4], unpack(ARGV, bodies, #ARGV))`},
		{"values=2-bucketed", `
redis.call('HSET', KEYS[5], unpack(ARGV, entries, items - 1))
redis.call('HSET', KEYS[4], unpack(ARGV, bodies, #ARGV))`},
		{"values=1", `
redis.call('HSET', KEYS[4], unpack(ARGV, bodies, #ARGV))`},
		{"segment", `
redis.call('HSET', KEYS[3], ARGV[entries], table.concat(ARGV, '', entries, #ARGV))`},
	} {
		b.Run(c.name, func(b *testing.B) {
			ctx := context.Background()
			require.NoError(b, g.Primary.Client().FlushAll(ctx).Err())
			script := redis.NewScript(fenced + c.writes + "\nreturn 1")
			require.NoError(b, script.Load(ctx, g.Primary.Client()).Err())
			set := g.Primary.SetRate(b)
			const writers, batch = 16, 32
			body := string(appendBody(nil, &store.Message{ID: "e:0:00000000", Topic: "t", Payload: make([]byte, 64), QoS: 1}))
			per := b.N/writers + 1
			b.ResetTimer()
			start, cpu0, script0 := time.Now(), g.CPU(), g.Primary.CommandTime("evalsha")
			done := make(chan error, writers)
			for w := range writers {
				go func() {
					c := redis.NewClient(&redis.Options{Addr: g.Primary.Addr})
					defer c.Close()
					session := fmt.Sprintf("{bench:%d}", w)
					keys := []string{"s:" + session, "ql:" + session, "qe:" + session, "", ""}
					args := make([]any, 0, 3+5*batch)
					for i := 0; i < per; i += batch {
						args = append(args[:0], 1, 1, batch)
						ids := make([]string, batch)
						for j := range ids {
							ids[j] = fmt.Sprintf("e:%d:%08d", w, i+j)
							args = append(args, ids[j], fmt.Sprintf(`{"s":%d,"m":"%s","q":1}`, i+j+1, ids[j]))
						}
						for j, id := range ids {
							args = append(args, fmt.Sprintf("%d:%s", i+j+1, id))
						}
						for _, id := range ids {
							// A call's bodies go to one bucket (the store's
							// take two when a call crosses a hundred).
							bucket, field := BodyKey(id, false)
							keys[3] = bucket
							keys[4] = "qe:" + session + bucket
							args = append(args, field, body)
						}
						p := c.Pipeline()
						script.EvalSha(ctx, p, keys, args...)
						p.Do(ctx, "WAIT", 1, 1000)
						if _, err := p.Exec(ctx); err != nil {
							done <- err
							return
						}
					}
					done <- nil
				}()
			}
			for range writers {
				require.NoError(b, <-done)
			}
			n := float64(per * writers)
			rate := n / time.Since(start).Seconds()
			b.ReportMetric(rate, "records/s")
			if set > 0 {
				b.ReportMetric(rate/set, "x-set")
			}
			b.ReportMetric(float64((g.CPU()-cpu0).Microseconds())/n, "redis-cpu-us/record")
			b.ReportMetric(float64((g.Primary.CommandTime("evalsha")-script0).Nanoseconds())/1e3/n, "script-us/record")
		})
	}
}
