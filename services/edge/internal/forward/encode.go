package forward

import (
	"slices"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/keelmq/keel/libs/commonwire"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Forwarded messages leave encoded by hand. The publishing edge built a
// commonv1.Message and an edgev1.ForwardMessage per message and had the
// runtime marshal them in the frame: about 600 bytes in four allocations
// and a sixth of the edge's CPU at QoS 0 across edges. A plain message
// (no shared targets, no trace, not routed again) is now encoded once, from
// the broker's message, into the bytes the runtime would write for
// ForwardMessage{Message: m.Proto(), SharedChosen: true}; the frame carries
// them as they are (Link.request). TestAppendForwardMessage holds it to
// the runtime's encoding, and FuzzAppendForwardMessage to its decoding.

// Field numbers of keel.common.v1.Message, MsgID and UserProperty, and of
// keel.edge.v1.ForwardMessage and ForwardRequest.
const (
	fMsgID, fTenant, fTopic, fPayload, fQoS, fRetain, fIngress, fClientID    = 1, 2, 3, 4, 5, 6, 7, 8
	fContentType, fResponseTopic, fCorrelation, fUserProps, fFormat, fExpiry = 9, 10, 11, 12, 13, 14
	fIDEdge, fIDIncarnation, fIDSeq                                          = 1, 2, 3
	fPropKey, fPropValue                                                     = 1, 2
	fFwdMessage, fFwdSharedChosen                                            = 1, 5
	fReqMessages                                                             = 5
)

// plainMessage is what the encoder writes of a broker message: its outside
// names, and the sizes of its nested messages.
type plainMessage struct {
	m                         *broker.Message
	tenant, topic, clientID   string
	idSize, msgSize, propSize int
}

// appendForwardMessage appends the encoding of ForwardMessage{Message:
// m.Proto(), SharedChosen: true} to b. ok is false, and b unchanged, for a
// message the encoder leaves to the runtime: one with a string that is not
// valid UTF-8 (the runtime refuses to marshal it), or outside any tenant.
func appendForwardMessage(b []byte, m *broker.Message) (_ []byte, ok bool) {
	pm, ok := plain(m)
	if !ok {
		return b, false
	}
	b = slices.Grow(b, protowire.SizeTag(fFwdMessage)+protowire.SizeBytes(pm.msgSize)+protowire.SizeTag(fFwdSharedChosen)+1)
	b = appendTag(b, fFwdMessage, protowire.BytesType)
	b = appendUvarint(b, uint64(pm.msgSize))
	b = pm.append(b)
	b = appendTag(b, fFwdSharedChosen, protowire.VarintType)
	return append(b, 1), true
}

func plain(m *broker.Message) (plainMessage, bool) {
	tenant, topic, ok := tenancy.TenantOfTopic(m.Topic)
	if !ok {
		return plainMessage{}, false
	}
	pm := plainMessage{m: m, tenant: tenant, topic: topic}
	if m.Origin != "" {
		_, pm.clientID, _ = tenancy.TenantOfClientID(m.Origin)
	}
	if !commonwire.ValidUTF8String(m.ID.Edge) || !commonwire.ValidUTF8String(tenant) ||
		!commonwire.ValidUTF8String(topic) || !commonwire.ValidUTF8String(pm.clientID) ||
		!commonwire.ValidUTF8String(m.Props.ContentType) || !commonwire.ValidUTF8String(m.Props.ResponseTopic) {
		return plainMessage{}, false
	}
	for _, u := range m.Props.User {
		if !commonwire.ValidUTF8String(u.Key) || !commonwire.ValidUTF8String(u.Val) {
			return plainMessage{}, false
		}
	}
	pm.idSize = sizeString(fIDEdge, m.ID.Edge) + sizeVarint(fIDIncarnation, m.ID.Incarnation) + sizeVarint(fIDSeq, m.ID.Seq)
	n := protowire.SizeTag(fMsgID) + protowire.SizeBytes(pm.idSize)
	n += sizeString(fTenant, tenant) + sizeString(fTopic, topic) + sizeBytes(fPayload, m.Payload)
	n += sizeVarint(fQoS, uint64(m.QoS)) + sizeBool(fRetain, m.Retain) + sizeVarint(fIngress, uint64(m.Created))
	n += sizeString(fClientID, pm.clientID) + sizeString(fContentType, m.Props.ContentType)
	n += sizeString(fResponseTopic, m.Props.ResponseTopic) + sizeBytes(fCorrelation, m.Props.CorrelationData)
	for _, u := range m.Props.User {
		s := sizeString(fPropKey, u.Key) + sizeString(fPropValue, u.Val)
		n += protowire.SizeTag(fUserProps) + protowire.SizeBytes(s)
	}
	if m.Props.PayloadFormatFlag {
		n += sizeVarint(fFormat, uint64(m.Props.PayloadFormat))
	}
	if e := m.Props.MessageExpiryInterval; e > 0 {
		n += protowire.SizeTag(fExpiry) + protowire.SizeVarint(uint64(e)) // optional: present when set
	}
	pm.msgSize = n
	return pm, true
}

// append writes the Message, fields in number order as the runtime does.
func (pm *plainMessage) append(b []byte) []byte {
	m := pm.m
	b = appendTag(b, fMsgID, protowire.BytesType)
	b = appendUvarint(b, uint64(pm.idSize))
	b = appendString(b, fIDEdge, m.ID.Edge)
	b = appendVarint(b, fIDIncarnation, m.ID.Incarnation)
	b = appendVarint(b, fIDSeq, m.ID.Seq)
	b = appendString(b, fTenant, pm.tenant)
	b = appendString(b, fTopic, pm.topic)
	b = appendBytes(b, fPayload, m.Payload)
	b = appendVarint(b, fQoS, uint64(m.QoS))
	if m.Retain {
		b = appendVarint(b, fRetain, 1)
	}
	b = appendVarint(b, fIngress, uint64(m.Created))
	b = appendString(b, fClientID, pm.clientID)
	b = appendString(b, fContentType, m.Props.ContentType)
	b = appendString(b, fResponseTopic, m.Props.ResponseTopic)
	b = appendBytes(b, fCorrelation, m.Props.CorrelationData)
	for _, u := range m.Props.User {
		b = appendTag(b, fUserProps, protowire.BytesType)
		b = appendUvarint(b, uint64(sizeString(fPropKey, u.Key)+sizeString(fPropValue, u.Val)))
		b = appendString(b, fPropKey, u.Key)
		b = appendString(b, fPropValue, u.Val)
	}
	if m.Props.PayloadFormatFlag {
		b = appendVarint(b, fFormat, uint64(m.Props.PayloadFormat))
	}
	if e := m.Props.MessageExpiryInterval; e > 0 {
		b = appendTag(b, fExpiry, protowire.VarintType)
		b = appendUvarint(b, uint64(e))
	}
	return b
}

// Proto3 leaves out a field at its zero value.

func sizeString(num protowire.Number, s string) int {
	if s == "" {
		return 0
	}
	return protowire.SizeTag(num) + protowire.SizeBytes(len(s))
}

func sizeBytes(num protowire.Number, v []byte) int {
	if len(v) == 0 {
		return 0
	}
	return protowire.SizeTag(num) + protowire.SizeBytes(len(v))
}

func sizeVarint(num protowire.Number, v uint64) int {
	if v == 0 {
		return 0
	}
	return protowire.SizeTag(num) + protowire.SizeVarint(v)
}

func sizeBool(num protowire.Number, v bool) int {
	if !v {
		return 0
	}
	return protowire.SizeTag(num) + 1
}

func appendString(b []byte, num protowire.Number, s string) []byte {
	if s == "" {
		return b
	}
	b = appendTag(b, num, protowire.BytesType)
	b = appendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func appendBytes(b []byte, num protowire.Number, v []byte) []byte {
	if len(v) == 0 {
		return b
	}
	b = appendTag(b, num, protowire.BytesType)
	b = appendUvarint(b, uint64(len(v)))
	return append(b, v...)
}

func appendVarint(b []byte, num protowire.Number, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = appendTag(b, num, protowire.VarintType)
	return appendUvarint(b, v)
}

// Every field the encoder writes has a number below 16, so its tag is one
// byte (TestAppendTag_OneByte): written here, inlined, rather than by
// protowire's general AppendVarint, which a profile of the publishing edge
// found to be the encoder's largest cost.
func appendTag(b []byte, num protowire.Number, typ protowire.Type) []byte {
	return append(b, byte(num)<<3|byte(typ))
}

// This fails to compile when a field number the encoder writes reaches 16,
// whose tag appendTag would get wrong.
const _ = uint8(15 - max(fMsgID, fTenant, fTopic, fPayload, fQoS, fRetain, fIngress, fClientID,
	fContentType, fResponseTopic, fCorrelation, fUserProps, fFormat, fExpiry,
	fIDEdge, fIDIncarnation, fIDSeq, fPropKey, fPropValue, fFwdMessage, fFwdSharedChosen))

// appendUvarint is protowire.AppendVarint with the one-byte case inlined:
// most lengths and small values take it.
func appendUvarint(b []byte, v uint64) []byte {
	if v < 0x80 {
		return append(b, byte(v))
	}
	return protowire.AppendVarint(b, v)
}
