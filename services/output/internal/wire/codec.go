package wire

import (
	"fmt"

	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the "proto" codec this one defers to
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// Codec is the "proto" codec of the output service's Connect handler. It
// reads a [PublishBatch] by hand, and everything else with the runtime.
type Codec struct{}

// Name is the codec's content subtype.
func (Codec) Name() string { return "proto" }

// Marshal encodes a protobuf message.
func (c Codec) Marshal(v any) ([]byte, error) { return c.MarshalAppend(nil, v) }

// MarshalAppend encodes a protobuf message after dst.
func (Codec) MarshalAppend(dst []byte, v any) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("wire: cannot encode %T", v)
	}
	return proto.MarshalOptions{}.MarshalAppend(dst, m)
}

// Unmarshal decodes b into v, a *PublishBatch or a protobuf message.
func (Codec) Unmarshal(b []byte, v any) error {
	switch v := v.(type) {
	case *PublishBatch:
		return v.Unmarshal(b)
	case proto.Message:
		return proto.Unmarshal(b, v)
	}
	return fmt.Errorf("wire: cannot decode into %T", v)
}

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
