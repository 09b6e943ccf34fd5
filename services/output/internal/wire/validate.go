// Package wire carries output records between an edge, the output host and
// its plugins without decoding the MQTT message inside them.
//
// The host reads a message's tenant, topic, payload size and ingress time,
// and passes everything else through: a record enters as the bytes of a
// keel.common.v1.Message in an edge's PublishRequest and leaves, wrapped as
// a keel.output.plugin.v1.Record, in a plugin's Write or Transform request.
// Decoding each message into Go structs and encoding it again cost about a
// third of the host's CPU per record.
//
// What the host passes on, a plugin decodes with the protobuf runtime: a
// record that the runtime would refuse would fail a plugin's whole batch,
// again on every retry. So every message and record is checked against its
// schema first ([Check]), with the runtime's rules, and refused alone.
package wire

import (
	"errors"
	"fmt"
	"sync"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// ErrMalformed is returned for bytes the protobuf runtime would not decode.
var ErrMalformed = errors.New("malformed protobuf")

// Check reports whether proto.Unmarshal would decode b as a message of md,
// without decoding it: the wire format must be well formed, strings valid
// UTF-8 and packed fields whole, in known fields and nested messages alike.
// A known field sent with another wire type is an unknown field to the
// runtime, and so it is here.
func Check(b []byte, md protoreflect.MessageDescriptor) error {
	return schemaOf(md).check(b, nil)
}

// schema is what Check needs of a message descriptor, indexed by field
// number: descriptors answer through interfaces and maps, which cost more
// than the check itself.
type schema struct {
	md     protoreflect.MessageDescriptor
	fields []protoreflect.FieldDescriptor // by number; nil: unknown
	nested []*schema                      // by number, for message fields
}

var schemas sync.Map // protoreflect.FullName → *schema, each complete

// schemaOf returns md's schema, built once. A schema is published only
// complete: one seen half built would take every field for unknown.
func schemaOf(md protoreflect.MessageDescriptor) *schema {
	if s, ok := schemas.Load(md.FullName()); ok {
		return s.(*schema)
	}
	s, _ := schemas.LoadOrStore(md.FullName(), buildSchema(md, map[protoreflect.FullName]*schema{}))
	return s.(*schema)
}

// buildSchema builds md's schema and those of the messages it holds;
// building maps what is under way, so that a recursive message refers to
// itself.
func buildSchema(md protoreflect.MessageDescriptor, building map[protoreflect.FullName]*schema) *schema {
	if s := building[md.FullName()]; s != nil {
		return s
	}
	s := &schema{md: md}
	building[md.FullName()] = s
	fds := md.Fields()
	top := 0
	for i := range fds.Len() {
		top = max(top, int(fds.Get(i).Number()))
	}
	s.fields = make([]protoreflect.FieldDescriptor, top+1)
	s.nested = make([]*schema, top+1)
	for i := range fds.Len() {
		fd := fds.Get(i)
		s.fields[fd.Number()] = fd
		if fd.Kind() == protoreflect.MessageKind {
			s.nested[fd.Number()] = buildSchema(fd.Message(), building)
		}
	}
	return s
}

// check is Check. If m is not nil, b is a keel.common.v1.Message, and the
// fields the host reads are read into m on the way.
func (s *schema) check(b []byte, m *Message) error {
	for len(b) > 0 {
		f, rest, err := nextField(b)
		if err != nil {
			return fmt.Errorf("%s: %w", s.md.FullName(), err)
		}
		b = rest
		if m != nil {
			m.set(f)
		}
		if f.typ != protowire.BytesType || int(f.num) >= len(s.fields) || s.fields[f.num] == nil {
			// Unknown, or a scalar whose wire form nextField checked.
			continue
		}
		fd := s.fields[f.num]
		var err2 error
		if sub := s.nested[f.num]; sub != nil {
			err2 = sub.check(f.val, nil)
		} else {
			err2 = checkLen(f.val, fd)
		}
		if err2 != nil {
			return fmt.Errorf("%s.%s: %w", s.md.FullName(), fd.Name(), err2)
		}
	}
	return nil
}

// field is one field of an encoded message.
type field struct {
	num protowire.Number
	typ protowire.Type
	// val is the value as encoded; for a length-delimited field, without
	// its length.
	val []byte
}

// nextField reads the first field of b and returns it and the rest of b.
func nextField(b []byte) (field, []byte, error) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return field{}, nil, fmt.Errorf("%w: %v", ErrMalformed, protowire.ParseError(n))
	}
	if num > protowire.MaxValidNumber {
		return field{}, nil, fmt.Errorf("%w: field number %d out of range", ErrMalformed, num)
	}
	b = b[n:]
	var v []byte
	switch typ {
	case protowire.BytesType:
		v, n = protowire.ConsumeBytes(b)
	case protowire.VarintType:
		_, n = protowire.ConsumeVarint(b)
	case protowire.Fixed32Type:
		_, n = protowire.ConsumeFixed32(b)
	case protowire.Fixed64Type:
		_, n = protowire.ConsumeFixed64(b)
	default:
		n = protowire.ConsumeFieldValue(num, typ, b)
	}
	if n < 0 {
		return field{}, nil, fmt.Errorf("%w: field %d: %v", ErrMalformed, num, protowire.ParseError(n))
	}
	if typ != protowire.BytesType {
		v = b[:n]
	}
	return field{num: num, typ: typ, val: v}, b[n:], nil
}

// checkLen checks the content of a length-delimited field fd that is not a
// message (those are checked by their schema).
func checkLen(v []byte, fd protoreflect.FieldDescriptor) error {
	switch k := fd.Kind(); k {
	case protoreflect.StringKind:
		if !utf8.Valid(v) {
			return fmt.Errorf("%w: invalid UTF-8", ErrMalformed)
		}
	case protoreflect.BytesKind, protoreflect.GroupKind, protoreflect.MessageKind:
		// Bytes are opaque; a group sent length-delimited is unknown;
		// messages are their schema's to check.
	default:
		if !fd.IsList() {
			return nil // a scalar sent length-delimited: unknown
		}
		// A packed repeated scalar: whole values only.
		for len(v) > 0 {
			var n int
			switch k {
			case protoreflect.Fixed32Kind, protoreflect.Sfixed32Kind, protoreflect.FloatKind:
				_, n = protowire.ConsumeFixed32(v)
			case protoreflect.Fixed64Kind, protoreflect.Sfixed64Kind, protoreflect.DoubleKind:
				_, n = protowire.ConsumeFixed64(v)
			default:
				_, n = protowire.ConsumeVarint(v)
			}
			if n < 0 {
				return fmt.Errorf("%w: packed: %v", ErrMalformed, protowire.ParseError(n))
			}
			v = v[n:]
		}
	}
	return nil
}
