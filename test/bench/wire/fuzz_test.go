package wire

import (
	"bytes"
	"testing"
)

// FuzzDecode checks that Decode never panics on hostile input, and that every
// packet it accepts re-encodes to the same bytes (header and body) and
// decodes back to an equal packet.
func FuzzDecode(f *testing.F) {
	for _, tc := range fixtures {
		f.Add(tc.raw)
	}
	for _, tc := range malformed {
		f.Add(tc.raw)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		p, n, err := Decode(in)
		if err != nil {
			return
		}
		if n <= 0 || n > len(in) {
			t.Fatalf("Decode used %d of %d bytes", n, len(in))
		}
		out, err := Append(nil, &p)
		if err != nil {
			t.Fatalf("Append of a decoded packet: %v (%+v)", err, p)
		}
		_, _, inHS, _ := ParseHeader(in)
		_, _, outHS, _ := ParseHeader(out)
		if in[0] != out[0] || !bytes.Equal(in[inHS:n], out[outHS:]) {
			t.Fatalf("re-encoding differs:\n in  %x\n out %x", in[:n], out)
		}
		p2, n2, err := Decode(out)
		if err != nil || n2 != len(out) {
			t.Fatalf("decode of re-encoding: n=%d err=%v", n2, err)
		}
		if !equalPackets(p, p2) {
			t.Fatalf("round trip changed the packet:\n %+v\n %+v", p, p2)
		}
	})
}

func equalPackets(a, b Packet) bool {
	ea, _ := Append(nil, &a)
	eb, _ := Append(nil, &b)
	return bytes.Equal(ea, eb) && a.Type == b.Type && a.ClientID == b.ClientID &&
		bytes.Equal(a.Topic, b.Topic) && bytes.Equal(a.Payload, b.Payload) && a.PacketID == b.PacketID
}
