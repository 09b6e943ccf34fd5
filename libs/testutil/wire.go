package testutil

import (
	"testing"

	"google.golang.org/protobuf/proto"
)

// DecodesAsRuntime holds a hand-written decoder to the protobuf runtime on
// input b: both fail, or both succeed with equal messages. want and got are
// messages of one type, want empty; got may hold what an earlier decode
// left, which must not survive. decode fills got from its argument, a copy
// of b that is overwritten before the comparison: what got holds must not
// alias it (a connection reuses its read buffer).
func DecodesAsRuntime(t testing.TB, b []byte, want, got proto.Message, decode func([]byte) error) {
	t.Helper()
	werr := proto.Unmarshal(b, want)
	input := append([]byte(nil), b...)
	gerr := decode(input)
	if (werr == nil) != (gerr == nil) {
		t.Fatalf("runtime error %v, decoder error %v", werr, gerr)
	}
	if werr != nil {
		return
	}
	for i := range input {
		input[i] ^= 0xff
	}
	if !proto.Equal(want, got) {
		t.Fatalf("decoded differently:\nruntime %v\ndecoder %v", want, got)
	}
}
