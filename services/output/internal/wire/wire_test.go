package wire

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	pluginv1 "github.com/keelmq/keel/proto/gen/keel/output/plugin/v1"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
)

func sampleMessage(seq uint64) *commonv1.Message {
	return &commonv1.Message{
		Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 7, Seq: seq},
		Tenant: "acme", Topic: "sensors/1/temp", Payload: []byte("21.5"), Qos: 1, Retain: true,
		IngressUnixNano: 1_700_000_000_000_000_000 + int64(seq), ClientId: "dev-1",
		ContentType: "text/plain", ResponseTopic: "reply/1", CorrelationData: []byte{0, 1},
		UserProperties: []*commonv1.UserProperty{{Key: "region", Value: "eu"}, {Key: "region", Value: "eu-2"}},
	}
}

func marshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	require.NoError(t, err)
	return b
}

// withField appends field num as a length-delimited value v: the runtime
// reads the last occurrence, so this overrides a string or bytes field.
func withField(b []byte, num protowire.Number, v []byte) []byte {
	b = protowire.AppendTag(append([]byte(nil), b...), num, protowire.BytesType)
	return protowire.AppendBytes(b, v)
}

// TestCheck_AgreesWithRuntime covers each way a message can be refused,
// and the ways that look wrong but are not.
func TestCheck_AgreesWithRuntime(t *testing.T) {
	good := marshal(t, sampleMessage(1))
	badUTF8 := []byte{0xff, 0xfe}
	userProp := marshal(t, &commonv1.UserProperty{Key: "k", Value: "v"})
	cases := map[string]struct {
		b  []byte
		ok bool
	}{
		"good":                      {good, true},
		"empty":                     {nil, true},
		"truncated":                 {good[:len(good)-1], false},
		"topic not UTF-8":           {withField(good, messageTopic, badUTF8), false},
		"nested string not UTF-8":   {withField(good, 12, withField(userProp, 2, badUTF8)), false},
		"payload any bytes":         {withField(good, messagePayload, badUTF8), true},
		"unknown field any bytes":   {withField(good, 900, badUTF8), true},
		"tenant as varint: unknown": {protowire.AppendVarint(protowire.AppendTag(append([]byte(nil), good...), messageTenant, protowire.VarintType), 5), true},
		"field number 0":            {append(append([]byte(nil), good...), 0x02, 0x00), false},
		"overlong varint":           {append(protowire.AppendTag(nil, messageIngress, protowire.VarintType), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01), false},
		"end group without start":   {protowire.AppendTag(nil, 900, protowire.EndGroupType), false},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			runtimeErr := proto.Unmarshal(c.b, &commonv1.Message{})
			require.Equal(t, c.ok, runtimeErr == nil, "runtime: %v", runtimeErr)
			err := Check(c.b, messageDesc)
			require.Equal(t, c.ok, err == nil, "Check: %v", err)
			if err != nil {
				require.ErrorIs(t, err, ErrMalformed)
			}
		})
	}
}

// FuzzCheck_AgreesWithRuntime: Check accepts exactly what proto.Unmarshal
// decodes, for a message and for a plugin record. A record the host
// passes on is one every plugin can decode.
func FuzzCheck_AgreesWithRuntime(f *testing.F) {
	good := marshal(f, sampleMessage(1))
	f.Add(good, false)
	f.Add(withField(good, messageTopic, []byte{0xc3}), false)
	rec := marshal(f, &pluginv1.Record{Message: sampleMessage(2), Destination: "t", Key: []byte{1},
		Headers: []*pluginv1.Header{{Key: "h", Value: []byte("v")}}})
	f.Add(rec, true)
	f.Add(rec[:len(rec)-3], true)
	f.Fuzz(func(t *testing.T, b []byte, asRecord bool) {
		var m proto.Message = &commonv1.Message{}
		if asRecord {
			m = &pluginv1.Record{}
		}
		runtimeErr := proto.Unmarshal(b, m)
		err := Check(b, m.ProtoReflect().Descriptor())
		if (err == nil) != (runtimeErr == nil) {
			t.Fatalf("Check: %v, runtime: %v", err, runtimeErr)
		}
	})
}

// FuzzPublishBatch_Unmarshal: for a request the runtime decodes, the batch
// reads the same fields, and each record, decoded by a plugin, is the
// runtime's message. For one it refuses, the batch fails or refuses a
// record.
func FuzzPublishBatch_Unmarshal(f *testing.F) {
	req := &outputv1.PublishRequest{BatchId: 9, EdgeId: "edge-1", Incarnation: 3, Records: []*outputv1.OutputRecord{
		{Message: sampleMessage(1)}, {Message: sampleMessage(2), Pipelines: []string{"acme/r"}}, {},
	}}
	good := marshal(f, req)
	f.Add(good)
	f.Add(good[:len(good)-5])
	// A record's message in two pieces, which the runtime merges; and split
	// inside a field, which it refuses.
	pieces := func(a, b []byte) []byte {
		or := protowire.AppendBytes(protowire.AppendTag(nil, outputMessage, protowire.BytesType), a)
		or = protowire.AppendBytes(protowire.AppendTag(or, outputMessage, protowire.BytesType), b)
		return protowire.AppendBytes(protowire.AppendTag(nil, publishRecords, protowire.BytesType), or)
	}
	m := sampleMessage(3)
	first := marshal(f, &commonv1.Message{Id: m.Id, Tenant: m.Tenant, Topic: "first"})
	f.Add(pieces(first, marshal(f, &commonv1.Message{Topic: m.Topic, Payload: m.Payload, IngressUnixNano: 5})))
	whole := marshal(f, m)
	f.Add(pieces(whole[:10], whole[10:]))
	f.Fuzz(func(t *testing.T, b []byte) {
		var want outputv1.PublishRequest
		runtimeErr := proto.Unmarshal(b, &want)
		var got PublishBatch
		err := got.Unmarshal(b)
		if runtimeErr != nil {
			if err != nil {
				return
			}
			for _, r := range got.Records {
				if errors.Is(r.Err, ErrMalformed) {
					return
				}
			}
			t.Fatalf("runtime refused (%v); the batch took every record", runtimeErr)
		}
		require.NoError(t, err)
		require.Equal(t, want.GetBatchId(), got.BatchID)
		require.Equal(t, want.GetEdgeId(), got.EdgeID)
		require.Equal(t, want.GetIncarnation(), got.Incarnation)
		require.Len(t, got.Records, len(want.GetRecords()))
		for i, w := range want.GetRecords() {
			r := got.Records[i]
			if w.Message == nil {
				require.ErrorIs(t, r.Err, ErrNoMessage)
				continue
			}
			require.NoError(t, r.Err)
			require.Equal(t, w.GetPipelines(), r.Pipelines)
			var dec pluginv1.Record
			require.NoError(t, proto.Unmarshal(r.Record.Enc, &dec))
			require.True(t, proto.Equal(w.GetMessage(), dec.GetMessage()), "record %d differs", i)
			require.Equal(t, w.GetMessage().GetTenant(), r.Message.Tenant)
			require.Equal(t, w.GetMessage().GetTopic(), r.Message.Topic)
			require.Equal(t, w.GetMessage().GetIngressUnixNano(), r.Record.Ingress)
			require.Equal(t, len(w.GetMessage().GetPayload()), r.Record.Payload)
		}
	})
}

// TestPublishBatch_DoesNotAliasInput: the caller reuses its buffer (Connect
// pools them), so nothing read may point into it.
func TestPublishBatch_DoesNotAliasInput(t *testing.T) {
	b := marshal(t, &outputv1.PublishRequest{BatchId: 1, Records: []*outputv1.OutputRecord{{Message: sampleMessage(1)}}})
	var p PublishBatch
	require.NoError(t, p.Unmarshal(b))
	clear(b)
	require.Equal(t, "acme", p.Records[0].Message.Tenant)
	require.Equal(t, "sensors/1/temp", p.Records[0].Message.Topic)
	var dec pluginv1.Record
	require.NoError(t, proto.Unmarshal(p.Records[0].Record.Enc, &dec))
	require.True(t, proto.Equal(sampleMessage(1), dec.GetMessage()))
}

// TestRecords_RoundTrip: a batch encoded by the host is the runtime's
// Write request, and a plugin's Transform response reads back as records
// with their ingress time and payload size.
func TestRecords_RoundTrip(t *testing.T) {
	var rs Records
	for i := range 3 {
		r, _, err := newRecord(marshal(t, sampleMessage(uint64(i+1))), nil)
		require.NoError(t, err)
		rs = append(rs, r)
	}
	enc := rs.AppendTo(nil)
	require.Len(t, enc, rs.size())
	var w pluginv1.SinkServiceWriteRequest
	require.NoError(t, proto.Unmarshal(enc, &w))
	require.Len(t, w.GetRecords(), 3)
	for i, r := range w.GetRecords() {
		require.True(t, proto.Equal(sampleMessage(uint64(i+1)), r.GetMessage()))
	}

	// A sink write with its sequence, through the gRPC codec.
	for _, seq := range []uint64{0, 1, 1 << 40} {
		sw := &SinkWrite{Records: rs, Sequence: seq, Follows: seq / 2}
		data, err := GRPCCodec{}.Marshal(sw)
		require.NoError(t, err)
		enc := data.Materialize()
		require.Len(t, enc, sw.size())
		w.Reset()
		require.NoError(t, proto.Unmarshal(enc, &w))
		require.Len(t, w.GetRecords(), 3)
		require.Equal(t, seq, w.GetSequence())
		require.Equal(t, seq/2, w.GetFollows())
	}

	// A transform's answer: records changed, one without a payload.
	m := sampleMessage(9)
	m.Payload = nil
	resp := &pluginv1.TransformServiceTransformResponse{Records: []*pluginv1.Record{
		{Message: sampleMessage(8), Destination: "other", Headers: []*pluginv1.Header{{Key: "k", Value: []byte("v")}}},
		{Message: m},
	}}
	back, err := ParseRecords(marshal(t, resp))
	require.NoError(t, err)
	require.Len(t, back, 2)
	require.Equal(t, sampleMessage(8).GetIngressUnixNano(), back[0].Ingress)
	require.Equal(t, 4, back[0].Payload)
	require.Zero(t, back[1].Payload)
	var dec pluginv1.Record
	require.NoError(t, proto.Unmarshal(back[0].Enc, &dec))
	require.True(t, proto.Equal(resp.GetRecords()[0], &dec))

	// A plugin that answers garbage fails the call, not the host.
	bad := withField(marshal(t, resp), recordMessage, withField(nil, recordMessage, withField(nil, messageTopic, []byte{0xff})))
	_, err = ParseRecords(bad)
	require.ErrorIs(t, err, ErrMalformed)
}

// TestCheck_FirstUseConcurrent: callers that meet a schema for the first
// time together each see it whole, so each refuses a bad string (a schema
// seen half built took every field for unknown).
func TestCheck_FirstUseConcurrent(t *testing.T) {
	md := (&pluginv1.RecordFailure{}).ProtoReflect().Descriptor() // used by no other test
	bad := withField(nil, 3, []byte{0xff})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() { errs <- Check(bad, md) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.ErrorIs(t, err, ErrMalformed)
	}
}
