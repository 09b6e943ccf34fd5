package forward

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"

	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/broker"
)

// BenchmarkFrame_EncodeDecodeDeliver is what one forwarded QoS 0 message
// costs beside the stream itself: the cluster form of the message, a frame
// of 32 encoded and decoded, and its delivery on the receiving edge (to no
// local subscriber, so only the conversion and the match count).
func BenchmarkFrame_EncodeDecodeDeliver(b *testing.B) {
	cfg := broker.DefaultConfig()
	cfg.EdgeID = "bench"
	brk, err := broker.New(cfg, auth.Anonymous{Tenant: "acme"}, nil, prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	msgs := make([]*broker.Message, 32)
	for i := range msgs {
		msgs[i] = &broker.Message{ID: broker.MsgID{Edge: "edge-a", Incarnation: 7, Seq: uint64(i)},
			Topic: "acme/sensors/room-1/temperature", Payload: make([]byte, 64), Origin: "11:acmesensor-001", Created: 1}
	}
	choice := broker.SharedChoice{Chosen: true}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i += len(msgs) {
		req := &edgev1.ForwardRequest{EdgeId: "edge-a", Incarnation: 7, Seq: uint64(i + 1)}
		for _, m := range msgs {
			req.Messages = append(req.Messages, &edgev1.ForwardMessage{Message: m.Proto(), SharedChosen: true})
		}
		wire, err := proto.Marshal(req)
		if err != nil {
			b.Fatal(err)
		}
		var got edgev1.ForwardRequest
		if err := proto.Unmarshal(wire, &got); err != nil {
			b.Fatal(err)
		}
		for _, fm := range got.GetMessages() {
			if err := brk.DeliverForwarded(context.Background(), fm.GetMessage(), choice); err != nil {
				b.Fatal(err)
			}
		}
	}
}
