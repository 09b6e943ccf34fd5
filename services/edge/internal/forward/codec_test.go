package forward

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
)

// frameSeeds are frames of every shape a sender makes, and some it does not.
func frameSeeds() [][]byte {
	exp := uint32(30)
	common := &edgev1.ForwardRequest{EdgeId: "edge-a", Incarnation: 7, TargetIncarnation: 3, Seq: 42, OutcomesConfirmed: 9}
	for i := range 4 {
		common.Messages = append(common.Messages, &edgev1.ForwardMessage{
			Message: &commonv1.Message{Id: &commonv1.MsgID{EdgeId: "edge-a", Incarnation: 7, Seq: uint64(i)},
				Tenant: "acme", Topic: "acme/sensors/1", Payload: []byte("payload"), Qos: uint32(i % 3), Retain: i == 1,
				IngressUnixNano: -5, ClientId: "c1", ContentType: "text/plain", ResponseTopic: "r", CorrelationData: []byte{0, 255},
				PayloadFormat: 1, MessageExpiryInterval: &exp},
			Filters: []string{"acme/sensors/#", "acme/+/1"}, SharedChosen: true, Traceparent: "00-01", SharedOnly: i == 2, SessionsSinceUnixNano: 77,
		})
	}
	uncommon := proto.Clone(common).(*edgev1.ForwardRequest)
	uncommon.Messages[1].Message.UserProperties = []*commonv1.UserProperty{{Key: "k", Value: "v"}}
	uncommon.Messages[2].Sessions = []*edgev1.SessionTarget{{Session: &commonv1.SessionKey{Tenant: "acme", ClientId: "x"}, Epoch: 4}}
	uncommon.Messages[3].Shared = []*edgev1.SharedTarget{{Group: "g"}}
	var seeds [][]byte
	for _, m := range []proto.Message{common, uncommon, &edgev1.ForwardRequest{}, &edgev1.ForwardRequest{EdgeId: "e", Seq: 1}} {
		b, err := proto.Marshal(m)
		if err != nil {
			panic(err)
		}
		seeds = append(seeds, b)
	}
	c, _ := proto.Marshal(common)
	// A field of a newer version, at each level; a message field twice;
	// a known field on another wire type; a string that is not UTF-8.
	seeds = append(seeds,
		protowire.AppendVarint(protowire.AppendTag(append([]byte(nil), c...), 99, protowire.VarintType), 1),
		protowire.AppendBytes(protowire.AppendTag(nil, 5, protowire.BytesType),
			protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 1)),
		protowire.AppendBytes(protowire.AppendTag(nil, 5, protowire.BytesType),
			protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType),
				protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 1))),
		protowire.AppendBytes(protowire.AppendTag(nil, 5, protowire.BytesType),
			append(protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), protowire.AppendString(protowire.AppendTag(nil, 3, protowire.BytesType), "a")),
				protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), protowire.AppendString(protowire.AppendTag(nil, 2, protowire.BytesType), "t"))...)),
		protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 5),
		protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), []byte{0xff, 0xfe}),
		protowire.AppendBytes(protowire.AppendTag(nil, 5, protowire.BytesType),
			protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), []byte{0xc0})),
		c[:len(c)-3],
	)
	return seeds
}

// FuzzDecodeForwardRequest holds decodeForwardRequest to the runtime: for
// any input both fail, or both succeed with equal messages.
func FuzzDecodeForwardRequest(f *testing.F) {
	for _, s := range frameSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var want, got edgev1.ForwardRequest
		// Garbage from an earlier decode must not survive.
		got.EdgeId, got.Messages = "stale", []*edgev1.ForwardMessage{{}}
		testutil.DecodesAsRuntime(t, b, &want, &got, func(in []byte) error { return decodeForwardRequest(in, &got) })
	})
}

func TestDecodeForwardRequest_Seeds(t *testing.T) {
	t.Parallel()
	for i, s := range frameSeeds() {
		var want, got edgev1.ForwardRequest
		werr := proto.Unmarshal(s, &want)
		gerr := decodeForwardRequest(append([]byte(nil), s...), &got)
		require.Equal(t, werr == nil, gerr == nil, "seed %d: runtime %v, decoder %v", i, werr, gerr)
		if werr == nil {
			require.True(t, proto.Equal(&want, &got), "seed %d", i)
		}
	}
}

// BenchmarkFrame_Decode compares the decoding of a frame of 32 common
// messages by the runtime and by decodeForwardRequest.
func BenchmarkFrame_Decode(b *testing.B) {
	req := &edgev1.ForwardRequest{EdgeId: "edge-a", Incarnation: 7, Seq: 1}
	for i := range 32 {
		req.Messages = append(req.Messages, &edgev1.ForwardMessage{Message: &commonv1.Message{
			Id:     &commonv1.MsgID{EdgeId: "edge-a", Incarnation: 7, Seq: uint64(i)},
			Tenant: "acme", Topic: "acme/sensors/room-1/temperature", Payload: make([]byte, 64), Qos: 0,
			ClientId: "11:acmesensor-001", IngressUnixNano: 1}, SharedChosen: true, Filters: []string{"acme/sensors/#"}})
	}
	wire, err := proto.Marshal(req)
	require.NoError(b, err)
	for _, c := range []struct {
		name   string
		decode func([]byte, *edgev1.ForwardRequest) error
	}{
		{"runtime", func(b []byte, r *edgev1.ForwardRequest) error { return proto.Unmarshal(b, r) }},
		{"frameCodec", decodeForwardRequest},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(wire)))
			for b.Loop() {
				var got edgev1.ForwardRequest
				if err := c.decode(wire, &got); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/32, "ns/msg")
		})
	}
}

// An append to a decoded payload does not write over the fields decoded
// after it from the same copy.
func TestDecodeForwardRequest_PayloadCapped(t *testing.T) {
	t.Parallel()
	b, err := proto.Marshal(&edgev1.ForwardRequest{EdgeId: "e", Seq: 1, Messages: []*edgev1.ForwardMessage{{
		Message: &commonv1.Message{Payload: []byte("p"), ClientId: "client", CorrelationData: []byte("c"), ContentType: "type"}}}})
	require.NoError(t, err)
	var req edgev1.ForwardRequest
	require.NoError(t, decodeForwardRequest(b, &req))
	m := req.GetMessages()[0].GetMessage()
	_ = append(m.Payload, "XXXXXXXXXXXX"...)
	_ = append(m.CorrelationData, "XXXXXXXXXXXX"...)
	require.Equal(t, "client", m.GetClientId())
	require.Equal(t, "type", m.GetContentType())
}
