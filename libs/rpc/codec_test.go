package rpc

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

type byHand struct{ got []byte }

func TestProtoCodec(t *testing.T) {
	t.Parallel()
	c := ProtoCodec(func(b []byte, into *byHand) error { into.got = b; return nil })
	require.Equal(t, "proto", c.Name())

	wire, err := c.Marshal(wrapperspb.String("x"))
	require.NoError(t, err)
	want, _ := proto.Marshal(wrapperspb.String("x"))
	require.Equal(t, want, wire)

	var h byHand
	require.NoError(t, c.Unmarshal(wire, &h), "T goes to decode")
	require.Equal(t, wire, h.got)
	var s wrapperspb.StringValue
	require.NoError(t, c.Unmarshal(wire, &s), "other messages to the runtime")
	require.Equal(t, "x", s.GetValue())
	require.Error(t, c.Unmarshal(wire, new(int)))
	_, err = c.Marshal(42)
	require.Error(t, err)
}
