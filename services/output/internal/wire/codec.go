package wire

import (
	"github.com/keelmq/keel/libs/rpc"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the "proto" codec this one defers to
	"google.golang.org/grpc/mem"
)

// Codec is the "proto" codec of the output service's Connect handler. It
// reads a [PublishBatch] by hand, and everything else with the runtime.
var Codec = rpc.ProtoCodec(func(b []byte, pb *PublishBatch) error { return pb.Unmarshal(b) })

// GRPCCodec is the gRPC codec of the host's plugin calls: it sends
// [Records] and [SinkWrite] as they are and reads them back checked, and defers to gRPC's
// protobuf codec for every other message. Use it per call
// (grpc.ForceCodecV2); plugins decode with the runtime.
type GRPCCodec struct{}

var protoCodec = encoding.GetCodecV2("proto")

// Name is the codec's content subtype: plugins see protobuf.
func (GRPCCodec) Name() string { return "proto" }

// Marshal encodes v.
func (GRPCCodec) Marshal(v any) (mem.BufferSlice, error) {
	switch v := v.(type) {
	case *Records:
		return mem.BufferSlice{mem.SliceBuffer(v.AppendTo(make([]byte, 0, v.size())))}, nil
	case *SinkWrite:
		return mem.BufferSlice{mem.SliceBuffer(v.AppendTo(make([]byte, 0, v.size())))}, nil
	}
	return protoCodec.Marshal(v)
}

// Unmarshal decodes data into v. Records alias a copy of data, since gRPC
// reuses its buffers.
func (GRPCCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if rs, ok := v.(*Records); ok {
		r, err := ParseRecords(data.Materialize())
		*rs = r
		return err
	}
	return protoCodec.Unmarshal(data, v)
}
