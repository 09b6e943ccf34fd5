package rpc

import (
	"fmt"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
)

// ProtoCodec returns the "proto" codec of a Connect handler that decodes
// the messages of type T with decode, where the protobuf runtime costs too
// much on a hot stream, and every other message, and every encoding, with
// the runtime. decode must accept exactly what the runtime does (hold it
// to that with a fuzz test); T need not be a protobuf message.
func ProtoCodec[T any](decode func(b []byte, into T) error) connect.Codec {
	return protoCodec[T]{decode: decode}
}

type protoCodec[T any] struct {
	decode func([]byte, T) error
}

func (protoCodec[T]) Name() string { return "proto" }

func (c protoCodec[T]) Marshal(v any) ([]byte, error) { return c.MarshalAppend(nil, v) }

// MarshalAppend lets Connect encode into its pooled buffers.
func (protoCodec[T]) MarshalAppend(dst []byte, v any) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("cannot encode %T", v)
	}
	return proto.MarshalOptions{}.MarshalAppend(dst, m)
}

func (c protoCodec[T]) Unmarshal(b []byte, v any) error {
	if t, ok := v.(T); ok {
		return c.decode(b, t)
	}
	if m, ok := v.(proto.Message); ok {
		return proto.Unmarshal(b, m)
	}
	return fmt.Errorf("cannot decode into %T", v)
}

func (protoCodec[T]) IsBinary() bool { return true }
