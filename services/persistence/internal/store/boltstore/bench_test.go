package boltstore

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// BenchmarkAppend measures one-record appends to 64 sessions, each waited
// for; ns/op is per acknowledged append. "serial" is one caller at a time,
// "parallel" 16 callers per CPU (an edge enqueuing for many clients), whose
// appends share commits; ops/commit is how many.
func BenchmarkAppend(b *testing.B) {
	for _, bc := range []struct {
		name string
		par  int
	}{{"serial", 0}, {"parallel", 16}} {
		b.Run(bc.name, func(b *testing.B) {
			s, err := Open(b.TempDir())
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = s.Close() })
			ctx := context.Background()
			const sessions = 64
			keys := make([]store.SessionKey, sessions)
			for i := range keys {
				keys[i] = store.SessionKey{Tenant: "bench", ClientID: strconv.Itoa(i)}
				if err := s.Activate(ctx, keys[i], store.Fence{Epoch: 1}); err != nil {
					b.Fatal(err)
				}
			}
			payload := make([]byte, 64)
			var seq atomic.Uint64
			one := func() {
				n := seq.Add(1)
				m := &store.Message{ID: "bench-edge/1/" + strconv.FormatUint(n, 10), Topic: "t", Payload: payload, QoS: 1, Created: 1}
				res, err := s.Append(ctx, keys[n%sessions], store.Fence{Epoch: 1}, store.QueueLimits{}, []store.Entry{{MsgID: m.ID, QoS: 1}}, []*store.Message{m})
				if err != nil || res.Added != 1 {
					b.Fatal(res, err)
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			if bc.par == 0 {
				for range b.N {
					one()
				}
				return
			}
			before := s.Stats()
			b.SetParallelism(bc.par)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					one()
				}
			})
			b.StopTimer()
			after := s.Stats()
			b.ReportMetric(float64(after.Ops-before.Ops)/float64(after.Commits-before.Commits), "ops/commit")
		})
	}
}
