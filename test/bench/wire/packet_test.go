package wire

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/require"
)

func TestDecode_Fixtures(t *testing.T) {
	t.Parallel()
	for _, tc := range fixtures {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, n, err := Decode(tc.raw)
			require.NoError(t, err)
			require.Equal(t, len(tc.raw), n)
			require.Equal(t, tc.packet, p)
		})
	}
}

func TestAppend_Fixtures(t *testing.T) {
	t.Parallel()
	for _, tc := range fixtures {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			out, err := Append([]byte{0xaa}, &tc.packet)
			require.NoError(t, err)
			require.Equal(t, append([]byte{0xaa}, tc.raw...), out)
		})
	}
}

func TestDecode_ShortBuffer(t *testing.T) {
	t.Parallel()
	for _, tc := range fixtures {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for i := range len(tc.raw) {
				_, _, err := Decode(tc.raw[:i])
				require.ErrorIs(t, err, ErrShortBuffer, "prefix of %d bytes", i)
			}
		})
	}
}

func TestDecode_Malformed(t *testing.T) {
	t.Parallel()
	for _, tc := range malformed {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, _, err := Decode(tc.raw)
			require.ErrorIs(t, err, ErrMalformed)
		})
	}
}

func TestAppendHelpers_MatchAppend(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		got  []byte
		want Packet
	}{
		{"connect", AppendConnect(nil, ConnectOptions{ClientID: "id", KeepAlive: 60, CleanSession: true, Username: "u", Password: []byte("p")}),
			Packet{Type: Connect, ProtocolName: "MQTT", ProtocolLevel: 4, ClientID: "id", KeepAlive: 60, CleanSession: true,
				HasUsername: true, Username: "u", HasPassword: true, Password: []byte("p")}},
		{"publish_qos1", AppendPublish(nil, []byte("a/b"), bytes.Repeat([]byte{7}, 300), 1, 9, true, true),
			Packet{Type: Publish, QoS: 1, PacketID: 9, Dup: true, Retain: true, Topic: []byte("a/b"), Payload: bytes.Repeat([]byte{7}, 300)}},
		{"pubrel", AppendAck(nil, Pubrel, 3), Packet{Type: Pubrel, PacketID: 3}},
		{"subscribe", AppendSubscribe(nil, 1, "bench/#", 2),
			Packet{Type: Subscribe, PacketID: 1, Subscriptions: []Subscription{{Filter: "bench/#", QoS: 2}}}},
		{"pingreq", AppendPingreq(nil), Packet{Type: Pingreq}},
		{"disconnect", AppendDisconnect(nil), Packet{Type: Disconnect}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, n, err := Decode(tc.got)
			require.NoError(t, err)
			require.Equal(t, len(tc.got), n)
			require.Equal(t, tc.want, p)
		})
	}
}

func TestAppend_Invalid(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		p    Packet
	}{
		{"publish_qos1_id_zero", Packet{Type: Publish, QoS: 1}},
		{"publish_qos0_dup", Packet{Type: Publish, Dup: true}},
		{"subscribe_empty", Packet{Type: Subscribe, PacketID: 1}},
		{"suback_empty", Packet{Type: Suback, PacketID: 1}},
		{"connect_password_only", Packet{Type: Connect, HasPassword: true}},
		{"reserved_type", Packet{Type: 15}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := Append(nil, &tc.p)
			require.ErrorIs(t, err, ErrInvalid)
		})
	}
}

func TestVarint_RoundTrip(t *testing.T) {
	t.Parallel()
	for _, n := range []int{0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152, MaxRemainingLength} {
		b := AppendVarint([]byte{0x30}, n)
		require.Len(t, b, 1+varintLen(n))
		_, rem, hs, err := ParseHeader(b)
		require.NoError(t, err)
		require.Equal(t, n, rem)
		require.Equal(t, len(b), hs)
	}
}

// TestReader_Stream feeds all fixtures through a Reader one byte per Read,
// and through a large packet that forces the buffer to grow.
func TestReader_Stream(t *testing.T) {
	t.Parallel()
	var stream []byte
	for _, f := range fixtures {
		stream = append(stream, f.raw...)
	}
	big := AppendPublish(nil, []byte("big"), bytes.Repeat([]byte{1}, 100_000), 1, 1, false, false)
	stream = append(stream, big...)

	for _, tc := range []struct {
		name string
		r    io.Reader
	}{
		{"one_byte_reads", iotest.OneByteReader(bytes.NewReader(stream))},
		{"half_reads", iotest.HalfReader(bytes.NewReader(stream))},
		{"whole", bytes.NewReader(stream)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			reads := 0
			r := NewReader(tc.r, 32, 0)
			r.BeforeRead = func() error { reads++; return nil }
			for _, f := range fixtures {
				h, body, err := r.Next()
				require.NoError(t, err)
				p, err := DecodeBody(h, body)
				require.NoError(t, err)
				require.Equal(t, f.packet, p, f.name)
			}
			h, body, err := r.Next()
			require.NoError(t, err)
			p, err := DecodeBody(h, body)
			require.NoError(t, err)
			require.Len(t, p.Payload, 100_000)
			_, _, err = r.Next()
			require.ErrorIs(t, err, io.EOF)
			require.Positive(t, reads)
		})
	}
}

func TestReader_TooLarge(t *testing.T) {
	t.Parallel()
	big := AppendPublish(nil, []byte("t"), make([]byte, 1000), 0, 0, false, false)
	r := NewReader(bytes.NewReader(big), 64, 512)
	_, _, err := r.Next()
	require.ErrorIs(t, err, ErrTooLarge)
}

func TestReader_BeforeReadError(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	r := NewReader(bytes.NewReader(nil), 64, 0)
	r.BeforeRead = func() error { return boom }
	_, _, err := r.Next()
	require.ErrorIs(t, err, boom)
}

func TestWriter_FlushOrder(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	w := NewWriter(&out, 16)
	require.Equal(t, 4, w.Ack(Puback, 1))
	w.Publish([]byte("t"), []byte("x"), 0, 0)
	require.NoError(t, w.Flush())
	w.Raw([]byte{0xc0, 0})
	require.Equal(t, 2, w.Pending())
	require.NoError(t, w.Flush())
	require.NoError(t, w.Flush())
	want := AppendAck(nil, Puback, 1)
	want = AppendPublish(want, []byte("t"), []byte("x"), 0, 0, false, false)
	want = append(want, 0xc0, 0)
	require.Equal(t, want, out.Bytes())
}
