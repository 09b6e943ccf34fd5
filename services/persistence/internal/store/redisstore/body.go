package redisstore

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"unicode/utf8"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// A message body as stored: bodyVersion, then the message's fields in a
// fixed order, strings and byte slices as a uvarint length and the bytes,
// times as varints, and QoS and retain in one byte. Lua never reads it
// (retained messages, which a script compares by creation time, stay
// JSON); it is a quarter of the size of the JSON it replaces (no base64)
// and costs no reflection either way.
const bodyVersion = 1

// errBody reports a stored body that does not decode.
var errBody = errors.New("stored message body does not decode")

// appendBody appends m's stored form to b.
func appendBody(b []byte, m *store.Message) []byte {
	b = append(b, bodyVersion)
	b = appendField(b, m.ID)
	b = appendField(b, m.Topic)
	b = appendField(b, m.Payload)
	flags := m.QoS & 3
	if m.Retain {
		flags |= 4
	}
	b = append(b, flags)
	b = appendField(b, m.Props)
	b = binary.AppendVarint(b, m.Created)
	return binary.AppendVarint(b, m.Expiry)
}

func appendField[T string | []byte](b []byte, v T) []byte {
	b = binary.AppendUvarint(b, uint64(len(v)))
	return append(b, v...)
}

// bodySize is the length of m's stored form.
func bodySize(m *store.Message) int {
	field := func(n int) int { return uvarintLen(uint64(n)) + n }
	zigzag := func(v int64) uint64 { return uint64(v<<1) ^ uint64(v>>63) }
	return 2 + field(len(m.ID)) + field(len(m.Topic)) + field(len(m.Payload)) + field(len(m.Props)) +
		uvarintLen(zigzag(m.Created)) + uvarintLen(zigzag(m.Expiry))
}

func uvarintLen(v uint64) int { return (bits.Len64(v|1) + 6) / 7 }

// parseBody decodes a stored body.
func parseBody(b []byte) (*store.Message, error) {
	d := bodyDecoder{b: b}
	if v := d.byte(); v != bodyVersion {
		return nil, fmt.Errorf("%w: version %d", errBody, v)
	}
	m := &store.Message{}
	m.ID = string(d.field())
	m.Topic = string(d.field())
	if p := d.field(); len(p) > 0 {
		m.Payload = append([]byte(nil), p...)
	}
	flags := d.byte()
	m.QoS, m.Retain = flags&3, flags&4 != 0
	if p := d.field(); len(p) > 0 {
		m.Props = append([]byte(nil), p...)
	}
	m.Created = d.varint()
	m.Expiry = d.varint()
	switch {
	case d.err != nil:
		return nil, d.err
	case len(d.b) > 0:
		return nil, fmt.Errorf("%w: %d bytes left over", errBody, len(d.b))
	case flags > 6 || m.QoS > 2:
		return nil, fmt.Errorf("%w: flags %#x", errBody, flags)
	case m.ID == "" || !utf8.ValidString(m.Topic):
		return nil, fmt.Errorf("%w: no ID, or a topic that is not UTF-8", errBody)
	}
	return m, nil
}

// bodyDecoder reads a body's fields; the first error sticks and makes every
// later read return nothing.
type bodyDecoder struct {
	b   []byte
	err error
}

func (d *bodyDecoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: truncated %s", errBody, what)
	}
	d.b = nil
}

func (d *bodyDecoder) byte() byte {
	if len(d.b) == 0 {
		d.fail("byte")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *bodyDecoder) field() []byte {
	n, k := binary.Uvarint(d.b)
	if k <= 0 || n > uint64(len(d.b)-k) {
		d.fail("field")
		return nil
	}
	v := d.b[k : k+int(n)]
	d.b = d.b[k+int(n):]
	return v
}

func (d *bodyDecoder) varint() int64 {
	v, k := binary.Varint(d.b)
	if k <= 0 {
		d.fail("number")
		return 0
	}
	d.b = d.b[k:]
	return v
}

// BodyKey names where the body of message id is kept: the field of the
// hash key (see the scripts' body). Messages of one ingress edge numbered
// alike share a key, a hundred to a key; those with an MQTT expiry
// (expiring) have keys of their own, which expire with them.
func BodyKey(id string, expiring bool) (key, field string) {
	prefix := "mb:"
	if expiring {
		prefix = "mx:"
	}
	if len(id) < 2 {
		return prefix, id
	}
	return prefix + id[:len(id)-2], id[len(id)-2:]
}
