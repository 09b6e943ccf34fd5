// Package commonwire decodes the protobuf encoding of keel.common.v1
// messages by hand, for the streams where the protobuf runtime's
// reflection and its allocation per nested message cost too much: an
// edge's forwarded frames and the persistence service's write batches.
//
// A decoder built on it accepts exactly what the runtime accepts (each
// user holds its own to that with a fuzz test against proto.Unmarshal).
// What it does not read itself (a field it does not know, a message field
// given twice, which the runtime merges, a known field on another wire
// type) it reports as [ErrUncommon], and the caller decodes that part with
// the runtime.
//
// Strings and byte fields alias the input: the caller decodes from a copy
// that nothing writes to afterwards.
package commonwire

import (
	"errors"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
)

// ErrUncommon stops the fast decoding of a part that holds something it
// leaves to the runtime.
var ErrUncommon = errors.New("uncommon encoding")

// ErrInvalidUTF8 is the runtime's refusal of a string field that is not
// UTF-8.
var ErrInvalidUTF8 = errors.New("string field contains invalid UTF-8")

// Message decodes a keel.common.v1.Message into m, its ID into id (which
// m.Id then points to), so that the two take one allocation of the
// caller's.
func Message(b []byte, m *commonv1.Message, id *commonv1.MsgID) error {
	for len(b) > 0 {
		num, typ, rest, err := Tag(b)
		if err != nil {
			return err
		}
		b = rest
		switch typ {
		case protowire.BytesType:
			v, rest, err := Bytes(b)
			if err != nil {
				return err
			}
			b = rest
			switch num {
			case 1:
				if m.Id != nil {
					return ErrUncommon // merged by the runtime
				}
				if err := MsgID(v, id); err != nil {
					return err
				}
				m.Id = id
			// Capped, so that an append to one never writes over the
			// fields after it in the shared copy.
			case 4:
				m.Payload = v[:len(v):len(v)]
			case 11:
				m.CorrelationData = v[:len(v):len(v)]
			case 2, 3, 8, 9, 10:
				s, err := AliasString(v)
				if err != nil {
					return err
				}
				switch num {
				case 2:
					m.Tenant = s
				case 3:
					m.Topic = s
				case 8:
					m.ClientId = s
				case 9:
					m.ContentType = s
				default:
					m.ResponseTopic = s
				}
			default:
				return ErrUncommon
			}
		case protowire.VarintType:
			v, rest, err := Varint(b)
			if err != nil {
				return err
			}
			b = rest
			switch num {
			case 5:
				m.Qos = uint32(v)
			case 6:
				m.Retain = v != 0
			case 7:
				m.IngressUnixNano = int64(v)
			case 13:
				m.PayloadFormat = uint32(v)
			case 14:
				e := uint32(v)
				m.MessageExpiryInterval = &e
			default:
				return ErrUncommon
			}
		default:
			return ErrUncommon
		}
	}
	return nil
}

// MsgID decodes a keel.common.v1.MsgID into id.
func MsgID(b []byte, id *commonv1.MsgID) error {
	for len(b) > 0 {
		num, typ, rest, err := Tag(b)
		if err != nil {
			return err
		}
		b = rest
		switch {
		case num == 1 && typ == protowire.BytesType:
			v, rest, err := Bytes(b)
			if err != nil {
				return err
			}
			s, err := AliasString(v)
			if err != nil {
				return err
			}
			id.EdgeId = s
			b = rest
		case (num == 2 || num == 3) && typ == protowire.VarintType:
			v, rest, err := Varint(b)
			if err != nil {
				return err
			}
			if num == 2 {
				id.Incarnation = v
			} else {
				id.Seq = v
			}
			b = rest
		default:
			return ErrUncommon
		}
	}
	return nil
}

// SessionKey decodes a keel.common.v1.SessionKey into k.
func SessionKey(b []byte, k *commonv1.SessionKey) error {
	for len(b) > 0 {
		num, v, rest, err := BytesField(b)
		if err != nil {
			return err
		}
		if num != 1 && num != 2 {
			return ErrUncommon
		}
		s, err := AliasString(v)
		if err != nil {
			return err
		}
		if num == 1 {
			k.Tenant = s
		} else {
			k.ClientId = s
		}
		b = rest
	}
	return nil
}

// AliasString returns v as a string without copying it: v is part of a
// message's own copy of its encoding, which nothing writes to.
func AliasString(v []byte) (string, error) {
	if !ValidUTF8(v) {
		return "", ErrInvalidUTF8
	}
	if len(v) == 0 {
		return "", nil
	}
	return unsafe.String(&v[0], len(v)), nil
}

// ValidUTF8 is utf8.Valid with the all-ASCII case, which names, topics
// and client IDs nearly always are, checked first in a loop the compiler
// inlines: utf8.Valid's call and setup cost more than a short string's
// bytes (11% of decoding a frame of forwarded messages).
func ValidUTF8(v []byte) bool {
	for i := 0; i < len(v); i++ {
		if v[i] >= utf8.RuneSelf {
			return utf8.Valid(v[i:])
		}
	}
	return true
}

// ValidUTF8String is [ValidUTF8] for a string.
func ValidUTF8String(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return utf8.ValidString(s[i:])
		}
	}
	return true
}

// Tag consumes a field's tag.
func Tag(b []byte) (protowire.Number, protowire.Type, []byte, error) {
	// A field numbered below 16 has a one-byte tag: most do, and this
	// check inlines where protowire's general decoder does not.
	if len(b) > 0 && b[0] < 0x80 && b[0]>>3 != 0 {
		return protowire.Number(b[0] >> 3), protowire.Type(b[0] & 7), b[1:], nil
	}
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return 0, 0, nil, protowire.ParseError(n)
	}
	return num, typ, b[n:], nil
}

// BytesField consumes a field of a message whose fields are all
// length-delimited: one on another wire type is ErrUncommon.
func BytesField(b []byte) (num protowire.Number, v, rest []byte, err error) {
	num, typ, rest, err := Tag(b)
	if err != nil {
		return 0, nil, nil, err
	}
	if typ != protowire.BytesType {
		return 0, nil, nil, ErrUncommon
	}
	v, rest, err = Bytes(rest)
	return num, v, rest, err
}

// VarintField consumes a field of a message whose fields are all varints:
// one on another wire type is ErrUncommon.
func VarintField(b []byte) (num protowire.Number, v uint64, rest []byte, err error) {
	num, typ, rest, err := Tag(b)
	if err != nil {
		return 0, 0, nil, err
	}
	if typ != protowire.VarintType {
		return 0, 0, nil, ErrUncommon
	}
	v, rest, err = Varint(rest)
	return num, v, rest, err
}

// Bytes consumes a length-delimited value.
func Bytes(b []byte) (v, rest []byte, err error) {
	if len(b) > 0 && b[0] < 0x80 && int(b[0]) < len(b) {
		n := 1 + int(b[0]) // a length below 128, in one byte
		return b[1:n], b[n:], nil
	}
	v, n := protowire.ConsumeBytes(b)
	if n < 0 {
		return nil, nil, protowire.ParseError(n)
	}
	return v, b[n:], nil
}

// Varint consumes a varint value.
func Varint(b []byte) (v uint64, rest []byte, err error) {
	if len(b) > 0 && b[0] < 0x80 {
		return uint64(b[0]), b[1:], nil
	}
	v, n := protowire.ConsumeVarint(b)
	if n < 0 {
		return 0, nil, protowire.ParseError(n)
	}
	return v, b[n:], nil
}
