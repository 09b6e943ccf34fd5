package broker

import (
	"encoding/binary"

	"github.com/mochi-mqtt/server/v2/packets"
)

// MQTT 5 PUBLISH property identifiers (MQTT 5.0 §2.2.2.2).
const (
	propPayloadFormat   = 0x01
	propMessageExpiry   = 0x02
	propContentType     = 0x03
	propResponseTopic   = 0x08
	propCorrelationData = 0x09
	propSubscriptionID  = 0x0B
	propTopicAlias      = 0x23
	propUserProperty    = 0x26
)

// outPublish is one PUBLISH as it leaves for one client.
type outPublish struct {
	topic    string // outside form; empty when alias is set and known to the client
	alias    uint16
	packetID uint16
	qos      byte
	retain   bool
	dup      bool
	expiry   uint32 // remaining message expiry in seconds; 0 = none
	subIDs   []int
	msg      *Message
}

// appendPublish appends the wire form of p to dst for a client of the given
// protocol version. It allocates nothing when dst has room. The mochi
// encoder allocates a few buffers per packet; on the delivery path that is
// the difference between the broker and the load.
func appendPublish(dst []byte, p *outPublish, version byte) []byte {
	m := p.msg
	// Variable header + payload length.
	n := 2 + len(p.topic) + len(m.Payload)
	if p.qos > 0 {
		n += 2
	}
	var propLen int
	if version == 5 {
		propLen = publishPropsLen(p)
		n += varintLen(propLen) + propLen
	}
	flags := byte(packets.Publish<<4) | p.qos<<1
	if p.retain {
		flags |= 1
	}
	if p.dup {
		flags |= 1 << 3
	}
	dst = append(dst, flags)
	dst = appendVarint(dst, n)
	dst = appendString(dst, p.topic)
	if p.qos > 0 {
		dst = binary.BigEndian.AppendUint16(dst, p.packetID)
	}
	if version == 5 {
		dst = appendVarint(dst, propLen)
		if m.Props.PayloadFormatFlag {
			dst = append(dst, propPayloadFormat, m.Props.PayloadFormat)
		}
		if p.expiry > 0 {
			dst = append(dst, propMessageExpiry)
			dst = binary.BigEndian.AppendUint32(dst, p.expiry)
		}
		if m.Props.ContentType != "" {
			dst = append(dst, propContentType)
			dst = appendString(dst, m.Props.ContentType)
		}
		if m.Props.ResponseTopic != "" {
			dst = append(dst, propResponseTopic)
			dst = appendString(dst, m.Props.ResponseTopic)
		}
		if len(m.Props.CorrelationData) > 0 {
			dst = append(dst, propCorrelationData)
			dst = binary.BigEndian.AppendUint16(dst, uint16(len(m.Props.CorrelationData)))
			dst = append(dst, m.Props.CorrelationData...)
		}
		for _, id := range p.subIDs {
			dst = append(dst, propSubscriptionID)
			dst = appendVarint(dst, id)
		}
		if p.alias > 0 {
			dst = append(dst, propTopicAlias)
			dst = binary.BigEndian.AppendUint16(dst, p.alias)
		}
		for _, u := range m.Props.User {
			dst = append(dst, propUserProperty)
			dst = appendString(dst, u.Key)
			dst = appendString(dst, u.Val)
		}
	}
	return append(dst, m.Payload...)
}

// publishSize returns the length appendPublish would produce.
func publishSize(p *outPublish, version byte) int {
	n := 2 + len(p.topic) + len(p.msg.Payload)
	if p.qos > 0 {
		n += 2
	}
	if version == 5 {
		pl := publishPropsLen(p)
		n += varintLen(pl) + pl
	}
	return 1 + varintLen(n) + n
}

func publishPropsLen(p *outPublish) int {
	m := p.msg
	n := 0
	if m.Props.PayloadFormatFlag {
		n += 2
	}
	if p.expiry > 0 {
		n += 5
	}
	if m.Props.ContentType != "" {
		n += 3 + len(m.Props.ContentType)
	}
	if m.Props.ResponseTopic != "" {
		n += 3 + len(m.Props.ResponseTopic)
	}
	if len(m.Props.CorrelationData) > 0 {
		n += 3 + len(m.Props.CorrelationData)
	}
	for _, id := range p.subIDs {
		n += 1 + varintLen(id)
	}
	if p.alias > 0 {
		n += 3
	}
	for _, u := range m.Props.User {
		n += 5 + len(u.Key) + len(u.Val)
	}
	return n
}

func appendString(dst []byte, s string) []byte {
	dst = binary.BigEndian.AppendUint16(dst, uint16(len(s)))
	return append(dst, s...)
}

func appendVarint(dst []byte, v int) []byte {
	for {
		b := byte(v % 128)
		v /= 128
		if v > 0 {
			b |= 0x80
		}
		dst = append(dst, b)
		if v == 0 {
			return dst
		}
	}
}

func varintLen(v int) int {
	switch {
	case v < 128:
		return 1
	case v < 16384:
		return 2
	case v < 2097152:
		return 3
	}
	return 4
}
