package commonwire

import (
	"errors"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
)

func messageSeeds() [][]byte {
	exp := uint32(0) // present though zero: the runtime keeps its presence
	full := &commonv1.Message{Id: &commonv1.MsgID{EdgeId: "edge-a", Incarnation: 3, Seq: 1 << 40}, Tenant: "acme", Topic: "acme/t",
		Payload: []byte{0, 1, 255}, Qos: 2, Retain: true, IngressUnixNano: -7, ClientId: "c", ContentType: "ct", ResponseTopic: "rt",
		CorrelationData: []byte("cd"), PayloadFormat: 1, MessageExpiryInterval: &exp}
	props := proto.Clone(full).(*commonv1.Message)
	props.UserProperties = []*commonv1.UserProperty{{Key: "k", Value: "v"}}
	var seeds [][]byte
	for _, m := range []proto.Message{full, props, &commonv1.Message{}} {
		b, err := proto.Marshal(m)
		if err != nil {
			panic(err)
		}
		seeds = append(seeds, b)
	}
	id := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), protowire.AppendVarint(protowire.AppendTag(nil, 3, protowire.VarintType), 9))
	seeds = append(seeds,
		append(append([]byte(nil), id...), id...), // the ID twice: merged by the runtime
		protowire.AppendBytes(protowire.AppendTag(nil, 3, protowire.BytesType), []byte{0xff}),
		protowire.AppendVarint(protowire.AppendTag(nil, 3, protowire.VarintType), 1),
		protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 1),
		seeds[0][:len(seeds[0])-2],
	)
	return seeds
}

// FuzzMessage holds Message to the runtime: where it decodes by itself
// (not ErrUncommon), it fails exactly when the runtime does, and otherwise
// decodes an equal message.
func FuzzMessage(f *testing.F) {
	for _, s := range messageSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var want, got commonv1.Message
		var id commonv1.MsgID
		werr := proto.Unmarshal(b, &want)
		gerr := Message(b, &got, &id)
		if errors.Is(gerr, ErrUncommon) {
			return // left to the runtime
		}
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("runtime error %v, decoder error %v", werr, gerr)
		}
		if werr == nil && !proto.Equal(&want, &got) {
			t.Fatalf("decoded differently:\nruntime %v\ndecoder %v", &want, &got)
		}
	})
}

// A decoded payload is capped at its own length: appending to it copies,
// and never writes over the fields after it in the input.
func TestMessage_PayloadCapped(t *testing.T) {
	b, err := proto.Marshal(&commonv1.Message{Payload: []byte("abc"), Topic: "t", CorrelationData: []byte("x")})
	require.NoError(t, err)
	var m commonv1.Message
	var id commonv1.MsgID
	require.NoError(t, Message(b, &m, &id))
	before := append([]byte(nil), b...)
	_ = append(m.Payload, 'z')
	_ = append(m.CorrelationData, 'z')
	require.Equal(t, before, b)
	require.Equal(t, "t", m.Topic)
}

func TestValidUTF8(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"", "a", "acme/sensors/1", "ü", "aü", "ab\xff", "\xff", "abc\xc3", "abcdefgh\xc3\xbc", "a\xed\xa0\x80", "a\u2028b"} {
		require.Equal(t, utf8.ValidString(s), ValidUTF8String(s), "%q", s)
		require.Equal(t, utf8.Valid([]byte(s)), ValidUTF8([]byte(s)), "%q", s)
	}
}
