package server

import (
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
)

// The fields of a [commonv1.Message] a stored message keeps in its Props:
// the publisher and the MQTT 5 properties, not the id, topic and payload
// it stores apart.
const (
	fieldTenant          = 2
	fieldClientID        = 8
	fieldContentType     = 9
	fieldResponseTopic   = 10
	fieldCorrelationData = 11
	fieldUserProperties  = 12
	fieldPayloadFormat   = 13
	fieldExpiryInterval  = 14
	fieldPropertyKey     = 1
	fieldPropertyValue   = 2
)

// appendProps appends the protobuf encoding of m's Props fields to b: the
// bytes proto.Marshal writes for a Message holding only those (fields in
// number order, empty ones left out), written without reflection, since
// every message of every append passes here. ok is false if a string is
// not UTF-8, which proto refuses too.
func appendProps(b []byte, m *commonv1.Message) (_ []byte, ok bool) {
	str := func(num protowire.Number, s string) bool {
		if s == "" {
			return true
		}
		if !utf8.ValidString(s) {
			return false
		}
		b = protowire.AppendTag(b, num, protowire.BytesType)
		b = protowire.AppendString(b, s)
		return true
	}
	if !str(fieldTenant, m.GetTenant()) || !str(fieldClientID, m.GetClientId()) ||
		!str(fieldContentType, m.GetContentType()) || !str(fieldResponseTopic, m.GetResponseTopic()) {
		return b, false
	}
	if c := m.GetCorrelationData(); len(c) > 0 {
		b = protowire.AppendTag(b, fieldCorrelationData, protowire.BytesType)
		b = protowire.AppendBytes(b, c)
	}
	for _, p := range m.GetUserProperties() {
		k, v := p.GetKey(), p.GetValue()
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return b, false
		}
		// Fields of a newer UserProperty go along, after the known ones,
		// as proto.Marshal writes them.
		unknown := p.ProtoReflect().GetUnknown()
		n := len(unknown)
		if k != "" {
			n += protowire.SizeTag(fieldPropertyKey) + protowire.SizeBytes(len(k))
		}
		if v != "" {
			n += protowire.SizeTag(fieldPropertyValue) + protowire.SizeBytes(len(v))
		}
		b = protowire.AppendTag(b, fieldUserProperties, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(n))
		if k != "" {
			b = protowire.AppendTag(b, fieldPropertyKey, protowire.BytesType)
			b = protowire.AppendString(b, k)
		}
		if v != "" {
			b = protowire.AppendTag(b, fieldPropertyValue, protowire.BytesType)
			b = protowire.AppendString(b, v)
		}
		b = append(b, unknown...)
	}
	if f := m.GetPayloadFormat(); f != 0 {
		b = protowire.AppendTag(b, fieldPayloadFormat, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(f))
	}
	if m.MessageExpiryInterval != nil {
		b = protowire.AppendTag(b, fieldExpiryInterval, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(m.GetMessageExpiryInterval()))
	}
	return b, true
}
