package wire

import (
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
)

// BenchmarkHostPath is the host's work per record between an edge's batch
// and a plugin's Write request, with the runtime (decode every message,
// encode it again) and in wire form: 1024 records of 256-byte payloads per
// batch, as edges send under load.
func BenchmarkHostPath(b *testing.B) {
	req := &outputv1.PublishRequest{BatchId: 1, EdgeId: "edge-1", Incarnation: 1}
	for i := range 1024 {
		m := sampleMessage(uint64(i + 1))
		m.Topic = fmt.Sprintf("sensors/%02d/data", i%16)
		m.Payload = make([]byte, 256)
		m.UserProperties = nil
		req.Records = append(req.Records, &outputv1.OutputRecord{Message: m})
	}
	enc := marshal(b, req)
	b.Run("path=runtime", func(b *testing.B) {
		b.SetBytes(int64(len(enc)))
		b.ReportAllocs()
		for b.Loop() {
			var in outputv1.PublishRequest
			if err := proto.Unmarshal(enc, &in); err != nil {
				b.Fatal(err)
			}
			w := &pluginv1.SinkServiceWriteRequest{Records: make([]*pluginv1.Record, 0, len(in.Records))}
			for _, r := range in.Records {
				w.Records = append(w.Records, &pluginv1.Record{Message: r.GetMessage()})
			}
			if _, err := proto.Marshal(w); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(req.Records)), "ns/record")
	})
	b.Run("path=wire", func(b *testing.B) {
		b.SetBytes(int64(len(enc)))
		b.ReportAllocs()
		for b.Loop() {
			var in PublishBatch
			if err := in.Unmarshal(enc); err != nil {
				b.Fatal(err)
			}
			rs := make(Records, 0, len(in.Records))
			for _, r := range in.Records {
				if r.Err != nil {
					b.Fatal(r.Err)
				}
				rs = append(rs, r.Record)
			}
			_ = rs.AppendTo(make([]byte, 0, rs.size()))
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(req.Records)), "ns/record")
	})
}
