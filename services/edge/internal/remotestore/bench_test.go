package remotestore

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
)

// BenchmarkEnqueue measures the QoS 1 hot path: a message enqueued for a
// persistent session and waited for (before the PUBACK), by many callers at
// once (16 per CPU) over 64 sessions, through one store and its one stream.
// ns/op is per acknowledged message.
func BenchmarkEnqueue(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			p := be.start(b)
			s := newStore(b, p.URL)
			ctx := context.Background()
			sc := scope(b, "bench")
			const sessions = 64
			ids := make([]string, sessions)
			for i := range ids {
				ids[i] = sc.ClientID(strconv.Itoa(i))
				require.NoError(b, s.Activate(ctx, ids[i], 1))
			}
			topic := sc.Topic("sensors/1/temp")
			payload := make([]byte, 64)
			var seq atomic.Uint64
			b.SetParallelism(16)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					n := seq.Add(1)
					m := &durable.Message{ID: "bench-edge/1/" + strconv.FormatUint(n, 10), Topic: topic, Payload: payload, QoS: 1,
						Props: []byte("{}"), Origin: ids[0], Created: base}
					if err := s.Enqueue(ids[n%sessions], durable.Entry{Seq: n, MsgID: m.ID, QoS: 1, Msg: m}).Wait(ctx); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.StopTimer()
			if batches := promtest.ToFloat64(s.m.batches); batches > 0 {
				b.ReportMetric(float64(b.N)/batches, "ops/batch")
			}
		})
	}
}
