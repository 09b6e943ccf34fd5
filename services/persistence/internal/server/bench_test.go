package server

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
	"github.com/keelmq/keel/services/persistence/internal/store/redisstore"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

func benchStore(b *testing.B, g *redistest.Group, minReplicas int) store.Store {
	s, err := redisstore.New(redisstore.Config{Addr: g.Primary.Addr, MinReplicas: minReplicas}, nil)
	require.NoError(b, err)
	b.Cleanup(func() { _ = s.Close() })
	return s
}

// BenchmarkServer_Write measures acknowledged records per second through
// the Write stream: 16 streams (one per session), each sending every batch
// without waiting (up to the server's in-flight bound); a batch is one
// append of `batch` records (one script call). Beside the rate it reports
// the CPU per record of the Redis processes and of this one (the service
// and its clients), and the rate as a share of `redis-benchmark -P 16 -t
// set` on the same primary, run just before, so that both see the same
// machine (x-set; the machine's speed moves by 2x within minutes).
// keel-persistence runs with GOGC=400 unless GOGC is set (main.go); run
// the benchmark the same way to measure what it does.
//
// "drained" dequeues each batch once it is acknowledged, so that Redis
// holds only what is in flight; the others keep everything they wrote.
// A run during which the servers forked (an AOF rewrite; see forks) comes
// out at about half the rate of one in which they did not.
func BenchmarkServer_Write(b *testing.B) {
	g := redistest.StartGroup(b, 2, 1)
	// Every round writes new messages (msgIDs of a new incarnation): an
	// append of a msgID already queued is answered as a duplicate without
	// a write, and would make the rate a cheaper one's.
	round := uint64(0)
	for _, c := range []struct {
		wait    int
		drained bool
	}{{1, false}, {1, true}, {0, false}} {
		for _, batch := range []int{32} {
			name := fmt.Sprintf("wait=%d/batch=%d", c.wait, batch)
			if c.drained {
				name += "/drained"
			}
			b.Run(name, func(b *testing.B) {
				set := g.Primary.SetRate(b)
				ts := startServer(b, benchStore(b, g, c.wait))
				const streams = 16
				payload := make([]byte, 64)
				per := b.N/(streams*batch) + 1
				round++
				var wg sync.WaitGroup
				errs := make(chan error, streams)
				b.ResetTimer() // the SET run and the server's start are not the rate's
				calls0, script0 := g.Primary.CommandStats("evalsha")
				start, cpu0, own0, forks0 := time.Now(), g.CPU(), processCPU(), g.Forks()
				for s := range streams {
					wg.Add(1)
					go func() {
						defer wg.Done()
						ctx, cancel := context.WithCancel(context.Background())
						defer cancel()
						st := ts.client.Write(ctx)
						key := &commonv1.SessionKey{Tenant: "bench", ClientId: fmt.Sprint(s)}
						incarnation := round*streams + uint64(s)
						// One request, its msgIDs renumbered for each batch:
						// Send has encoded it when it returns, and the load
						// generator's own allocations are not the service's.
						a := &persistencev1.AppendOp{}
						ids := make([]*commonv1.MsgID, batch)
						for i := range batch {
							ids[i] = &commonv1.MsgID{EdgeId: "e", Incarnation: incarnation}
							a.Entries = append(a.Entries, &persistencev1.Entry{MsgId: ids[i], Qos: 1})
							a.Messages = append(a.Messages, &commonv1.Message{Id: ids[i], Topic: "t", Payload: payload, Qos: 1})
						}
						fence := &persistencev1.Fence{Epoch: 1}
						req := &persistencev1.WriteRequest{Ops: []*persistencev1.WriteOp{{Session: key, Fence: fence, Op: &persistencev1.WriteOp_Append{Append: a}}}}
						// Drained, each batch is dequeued once acknowledged, as
						// a subscriber's acknowledgements take what it was sent:
						// Redis holds what is in flight, not everything written.
						d := &persistencev1.DequeueOp{}
						for range batch {
							d.MsgIds = append(d.MsgIds, &commonv1.MsgID{EdgeId: "e", Incarnation: incarnation})
						}
						dreq := &persistencev1.WriteRequest{Ops: []*persistencev1.WriteOp{{Session: key, Fence: fence, Op: &persistencev1.WriteOp_Dequeue{Dequeue: d}}}}
						// Appends are batches 0 to per-1, dequeues per and up.
						firstDequeue := uint64(per)
						acked := make(chan uint64, per)
						dequeue := func() error {
							var i uint64
							select {
							case i = <-acked:
							case <-ctx.Done():
								return ctx.Err()
							}
							dreq.BatchId = firstDequeue + i
							for j, id := range d.MsgIds {
								id.Seq = i*uint64(batch) + uint64(j) + 1
							}
							return st.Send(dreq)
						}
						go func() {
							dequeued := 0
							for i := range per {
								req.BatchId = uint64(i)
								for j, id := range ids {
									id.Seq = uint64(i)*uint64(batch) + uint64(j) + 1
								}
								if st.Send(req) != nil {
									return
								}
								for c.drained && len(acked) > 0 {
									if dequeue() != nil {
										return
									}
									dequeued++
								}
							}
							for c.drained && dequeued < per {
								if dequeue() != nil {
									return
								}
								dequeued++
							}
						}()
						answers := per
						if c.drained {
							answers *= 2
						}
						for range answers {
							r, err := st.Receive()
							if err != nil || r.GetStatus() != persistencev1.WriteStatus_WRITE_STATUS_OK {
								errs <- fmt.Errorf("%v %v %s", err, r.GetStatus(), r.GetError())
								return
							}
							if c.drained && r.GetBatchId() < firstDequeue {
								acked <- r.GetBatchId()
							}
						}
						_ = st.CloseRequest()
					}()
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					b.Fatal(err)
				}
				rate := float64(per*streams*batch) / time.Since(start).Seconds()
				b.ReportMetric(rate, "records/s")
				if set > 0 {
					b.ReportMetric(set, "set/s")
					b.ReportMetric(rate/set, "x-set")
				}
				b.ReportMetric(float64((g.CPU()-cpu0).Microseconds())/float64(per*streams*batch), "redis-cpu-us/record")
				b.ReportMetric(float64((processCPU()-own0).Microseconds())/float64(per*streams*batch), "go-cpu-us/record")
				if calls, script := g.Primary.CommandStats("evalsha"); calls > calls0 {
					// How many records a script call carried (merged appends
					// of one session and its commit's other sessions), and
					// the primary's time in scripts per record.
					b.ReportMetric(float64(per*streams*batch)/float64(calls-calls0), "records/call")
					b.ReportMetric(float64((script-script0).Microseconds())/float64(per*streams*batch), "script-us/record")
				}
				b.ReportMetric(float64(g.Forks()-forks0), "forks")
			})
		}
	}
}

// processCPU is the CPU time this process used (user and system): in the
// Write benchmark, the service and its clients, so the Go side of a
// record's cost beside Redis's.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkServer_LoadSession measures a session resume with 1,000 queued
// messages (64 B payloads) through LoadSession.
func BenchmarkServer_LoadSession(b *testing.B) {
	g := redistest.StartGroup(b, 2, 1)
	st := benchStore(b, g, 1)
	ts := startServer(b, st)
	k := store.SessionKey{Tenant: "acme", ClientID: "dev-1"}
	f := store.Fence{Epoch: 1}
	require.NoError(b, st.Activate(b.Context(), k, f))
	for i := 0; i < 1000; i += 100 {
		var es []store.Entry
		var ms []*store.Message
		for j := i; j < i+100; j++ {
			id := fmt.Sprintf("e/1/%d", j+1)
			es = append(es, store.Entry{MsgID: id, QoS: 1})
			ms = append(ms, &store.Message{ID: id, Topic: "a/b", Payload: make([]byte, 64), QoS: 1})
		}
		_, err := st.Append(b.Context(), k, f, store.QueueLimits{}, es, ms)
		require.NoError(b, err)
	}
	var lat []time.Duration
	for b.Loop() {
		t0 := time.Now()
		r, err := ts.client.LoadSession(b.Context(), connect.NewRequest(&persistencev1.LoadSessionRequest{Session: sess}))
		lat = append(lat, time.Since(t0))
		if err != nil || len(r.Msg.GetQueue()) != 1000 {
			b.Fatal(err)
		}
	}
	reportPercentiles(b, lat)
}

func reportPercentiles(b *testing.B, lat []time.Duration) {
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
}

// BenchmarkServer_LookupRetained measures wildcard lookups with `topics`
// retained topics "site/<s>/dev/<d>/temp" (100 sites); each lookup
// "site/<s>/dev/+/temp" matches topics/100 of them, capped at 100 returned.
// KEEL_PERSISTENCE_BENCH_TOPICS sets the count (default 100,000).
func BenchmarkServer_LookupRetained(b *testing.B) {
	topics := 100_000
	if v, err := strconv.Atoi(os.Getenv("KEEL_PERSISTENCE_BENCH_TOPICS")); err == nil && v > 0 {
		topics = v
	}
	{
		b.Run(fmt.Sprintf("topics=%d", topics), func(b *testing.B) {
			g := redistest.StartGroup(b, 1, 1)
			st := benchStore(b, g, 1)
			ts := startServer(b, st)
			var ops []store.Op
			var waits []func() []store.OpResult
			for i := range topics {
				tp := fmt.Sprintf("site/%d/dev/%d/temp", i%100, i/100)
				ops = append(ops, store.Op{Kind: store.OpPutRetained, Tenant: "acme", Retained: &store.Message{ID: fmt.Sprintf("e/1/%d", i+1), Topic: tp, Payload: []byte("21.5"), QoS: 0, Created: int64(i + 1)}})
				if len(ops) == 1000 {
					waits = append(waits, store.Submit(b.Context(), st, ops))
					ops = nil
				}
			}
			for _, w := range waits {
				for _, r := range w() {
					require.NoError(b, r.Err)
				}
			}
			var lat []time.Duration
			i := 0
			for b.Loop() {
				i++
				t0 := time.Now()
				r, err := ts.client.LookupRetained(b.Context(), connect.NewRequest(&persistencev1.LookupRetainedRequest{Tenant: "acme", Filter: fmt.Sprintf("site/%d/dev/+/temp", i%100), Limit: 100}))
				lat = append(lat, time.Since(t0))
				if err != nil || len(r.Msg.GetMessages()) != 100 {
					b.Fatal(err, len(r.Msg.GetMessages()))
				}
			}
			reportPercentiles(b, lat)
		})
	}
}
