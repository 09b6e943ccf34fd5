package server

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// writeSeeds are write batches of every shape an edge sends, and some it
// does not.
func writeSeeds() [][]byte {
	exp := uint32(30)
	key := &commonv1.SessionKey{Tenant: "acme", ClientId: "dev-1"}
	fence := &persistencev1.Fence{Epoch: 7, GroupEpoch: 2}
	app := &persistencev1.AppendOp{Limits: &persistencev1.QueueLimits{MaxLen: 1000, DropOldest: true, TenantQuota: true}}
	for i := range 3 {
		id := &commonv1.MsgID{EdgeId: "edge-a", Incarnation: 4, Seq: uint64(i + 1)}
		app.Entries = append(app.Entries, &persistencev1.Entry{MsgId: id, Qos: 2, Retain: i == 1, Seq: uint64(10 + i), TookQos2: i == 2})
		app.Messages = append(app.Messages, &commonv1.Message{Id: id, Tenant: "acme", Topic: "acme/t", Payload: []byte{byte(i), 0, 255},
			Qos: 2, Retain: i == 1, IngressUnixNano: 1e18, ClientId: "pub", ContentType: "c", ResponseTopic: "r",
			CorrelationData: []byte("x"), PayloadFormat: 1, MessageExpiryInterval: &exp})
	}
	common := &persistencev1.WriteRequest{BatchId: 9, Ops: []*persistencev1.WriteOp{
		{Session: key, Fence: fence, Op: &persistencev1.WriteOp_Append{Append: app}},
		{Session: key, Fence: fence, Op: &persistencev1.WriteOp_Send{Send: &persistencev1.SendOp{Entries: []*persistencev1.Entry{
			{MsgId: &commonv1.MsgID{EdgeId: "edge-a", Incarnation: 4, Seq: 1}, Qos: 1, PacketId: 42, Pubrel: true}}}}},
		{Session: key, Fence: fence, Op: &persistencev1.WriteOp_Complete{Complete: &persistencev1.CompleteOp{PacketIds: []uint32{42, 7, 65535}}}},
		{Session: key, Fence: fence, Op: &persistencev1.WriteOp_Append{Append: &persistencev1.AppendOp{}}},
	}}
	uncommon := proto.Clone(common).(*persistencev1.WriteRequest)
	uncommon.Ops[0].GetAppend().Entries[1].SubscriptionIdentifiers = []uint32{3, 4}
	uncommon.Ops[0].GetAppend().Messages[2].UserProperties = []*commonv1.UserProperty{{Key: "k", Value: "v"}}
	uncommon.Ops = append(uncommon.Ops,
		&persistencev1.WriteOp{Session: key, Fence: fence, Op: &persistencev1.WriteOp_PutSession{PutSession: &persistencev1.PutSessionOp{
			Session: &persistencev1.Session{ProtocolVersion: 5, SessionExpiryInterval: 60, DisconnectedUnixNano: 5}}}},
		&persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutRetained{PutRetained: &persistencev1.PutRetainedOp{}}})
	var seeds [][]byte
	for _, m := range []proto.Message{common, uncommon, &persistencev1.WriteRequest{}, &persistencev1.WriteRequest{BatchId: 1}} {
		b, err := proto.Marshal(m)
		if err != nil {
			panic(err)
		}
		seeds = append(seeds, b)
	}
	c, _ := proto.Marshal(common)
	op := func(b []byte) []byte {
		return protowire.AppendBytes(protowire.AppendTag(nil, fReqOps, protowire.BytesType), b)
	}
	field := func(num protowire.Number, b []byte) []byte {
		return protowire.AppendBytes(protowire.AppendTag(nil, num, protowire.BytesType), b)
	}
	varint := func(num protowire.Number, v uint64) []byte {
		return protowire.AppendVarint(protowire.AppendTag(nil, num, protowire.VarintType), v)
	}
	seeds = append(seeds,
		// A field of a newer version, at the top and in an op.
		append(append([]byte(nil), c...), varint(99, 1)...),
		op(varint(99, 1)),
		// An op's oneof given twice, a session given twice (merged).
		op(append(field(fOpAppend, nil), field(fOpComplete, nil)...)),
		op(append(field(fOpSession, field(1, []byte("a"))), field(fOpSession, field(2, []byte("b")))...)),
		// Packet IDs unpacked, and packed with a bad varint.
		op(field(fOpComplete, append(varint(1, 5), varint(1, 1<<40)...))),
		op(field(fOpComplete, field(1, []byte{0x80}))),
		// An entry's msgID twice, a string that is not UTF-8, a known
		// field on another wire type.
		op(field(fOpSend, field(1, append(field(1, field(1, []byte("e"))), field(1, varint(3, 9))...)))),
		op(field(fOpAppend, field(fAppMsg, field(3, []byte{0xff, 0xfe})))),
		op(field(fOpFence, field(fFenceEpoch, nil))),
		c[:len(c)-3],
	)
	return seeds
}

// FuzzDecodeWriteRequest holds decodeWriteRequest to the runtime: for any
// input both fail, or both succeed with equal messages, and the decoded
// request does not alias the input (Connect reuses its buffer).
func FuzzDecodeWriteRequest(f *testing.F) {
	for _, s := range writeSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var want, got persistencev1.WriteRequest
		got.BatchId, got.Ops = 77, []*persistencev1.WriteOp{{}} // garbage from an earlier decode must not survive
		testutil.DecodesAsRuntime(t, b, &want, &got, func(in []byte) error { return decodeWriteRequest(in, &got) })
	})
}

// BenchmarkDecodeWriteRequest decodes a batch of 32 appended records, as
// an edge writes them, by hand and with the runtime.
func BenchmarkDecodeWriteRequest(b *testing.B) {
	app := &persistencev1.AppendOp{Limits: &persistencev1.QueueLimits{MaxLen: 1000}}
	for i := range 32 {
		id := &commonv1.MsgID{EdgeId: "edge-a", Incarnation: 4, Seq: uint64(i + 1)}
		app.Entries = append(app.Entries, &persistencev1.Entry{MsgId: id, Qos: 1, Seq: uint64(i + 1)})
		app.Messages = append(app.Messages, &commonv1.Message{Id: id, Tenant: "acme", Topic: "acme/sensors/1", Payload: make([]byte, 64),
			Qos: 1, IngressUnixNano: 1e18, ClientId: "pub"})
	}
	req := &persistencev1.WriteRequest{BatchId: 1, Ops: []*persistencev1.WriteOp{{Session: &commonv1.SessionKey{Tenant: "acme", ClientId: "dev"},
		Fence: &persistencev1.Fence{Epoch: 3}, Op: &persistencev1.WriteOp_Append{Append: app}}}}
	raw, err := proto.Marshal(req)
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		decode func([]byte, *persistencev1.WriteRequest) error
	}{
		{"by_hand", decodeWriteRequest},
		{"runtime", func(b []byte, r *persistencev1.WriteRequest) error { return proto.Unmarshal(b, r) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(raw)))
			for b.Loop() {
				var r persistencev1.WriteRequest
				if err := c.decode(raw, &r); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*32), "ns/record")
		})
	}
}
