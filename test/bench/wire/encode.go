package wire

import (
	"fmt"
	"math"
)

// ConnectOptions are the CONNECT fields a load-generating client sets.
type ConnectOptions struct {
	ClientID     string
	KeepAlive    uint16
	CleanSession bool
	Username     string // sent when non-empty
	Password     []byte // sent when non-nil; requires Username
}

// AppendConnect appends an MQTT 3.1.1 CONNECT.
func AppendConnect(dst []byte, o ConnectOptions) []byte {
	p := Packet{
		Type: Connect, ProtocolName: "MQTT", ProtocolLevel: 4,
		CleanSession: o.CleanSession, KeepAlive: o.KeepAlive, ClientID: o.ClientID,
		HasUsername: o.Username != "", Username: o.Username,
		HasPassword: o.Password != nil, Password: o.Password,
	}
	out, err := Append(dst, &p)
	if err != nil {
		panic(err) // unreachable: the fields above are always in range
	}
	return out
}

// AppendPublish appends a PUBLISH. packetID is ignored for QoS 0.
func AppendPublish(dst []byte, topic []byte, payload []byte, qos byte, packetID uint16, dup, retain bool) []byte {
	h := Publish<<4 | qos<<1
	if dup {
		h |= 0x08
	}
	if retain {
		h |= 0x01
	}
	rem := 2 + len(topic) + len(payload)
	if qos > 0 {
		rem += 2
	}
	dst = append(dst, h)
	dst = AppendVarint(dst, rem)
	dst = append(dst, byte(len(topic)>>8), byte(len(topic)))
	dst = append(dst, topic...)
	if qos > 0 {
		dst = append(dst, byte(packetID>>8), byte(packetID))
	}
	return append(dst, payload...)
}

// AppendAck appends a two-byte-body acknowledgement: PUBACK, PUBREC, PUBREL,
// PUBCOMP or UNSUBACK. PUBREL gets its mandatory 0x02 flags.
func AppendAck(dst []byte, t byte, packetID uint16) []byte {
	return append(dst, t<<4|requiredFlags(t), 2, byte(packetID>>8), byte(packetID))
}

// AppendSubscribe appends a SUBSCRIBE with one topic filter.
func AppendSubscribe(dst []byte, packetID uint16, filter string, qos byte) []byte {
	rem := 2 + 2 + len(filter) + 1
	dst = append(dst, Subscribe<<4|0x02)
	dst = AppendVarint(dst, rem)
	dst = append(dst, byte(packetID>>8), byte(packetID), byte(len(filter)>>8), byte(len(filter)))
	dst = append(dst, filter...)
	return append(dst, qos)
}

// AppendPingreq appends a PINGREQ.
func AppendPingreq(dst []byte) []byte { return append(dst, Pingreq<<4, 0) }

// AppendDisconnect appends a DISCONNECT.
func AppendDisconnect(dst []byte) []byte { return append(dst, Disconnect<<4, 0) }

// Append appends the encoding of any packet to dst.
func Append(dst []byte, p *Packet) ([]byte, error) {
	switch p.Type {
	case Publish:
		if p.QoS > 2 || (p.QoS > 0 && p.PacketID == 0) || (p.QoS == 0 && p.Dup) {
			return dst, fmt.Errorf("%w: publish qos %d id %d dup %t", ErrInvalid, p.QoS, p.PacketID, p.Dup)
		}
		if len(p.Topic) > math.MaxUint16 || 2+len(p.Topic)+2+len(p.Payload) > MaxRemainingLength {
			return dst, fmt.Errorf("%w: publish too large", ErrInvalid)
		}
		return AppendPublish(dst, p.Topic, p.Payload, p.QoS, p.PacketID, p.Dup, p.Retain), nil
	case Puback, Pubrec, Pubrel, Pubcomp, Unsuback:
		return AppendAck(dst, p.Type, p.PacketID), nil
	case Pingreq, Pingresp, Disconnect:
		return append(dst, p.Type<<4, 0), nil
	case Connack:
		sp := byte(0)
		if p.SessionPresent {
			sp = 1
		}
		return append(dst, Connack<<4, 2, sp, p.ReturnCode), nil
	}

	// Variable-length packets: build the body after a placeholder, then
	// prepend the header. These are rare, so an extra copy does not matter.
	var body []byte
	var err error
	switch p.Type {
	case Connect:
		body, err = appendConnectBody(nil, p)
	case Subscribe, Unsubscribe:
		if len(p.Subscriptions) == 0 {
			return dst, fmt.Errorf("%w: no subscriptions", ErrInvalid)
		}
		body = append(body, byte(p.PacketID>>8), byte(p.PacketID))
		for _, s := range p.Subscriptions {
			if body, err = appendString(body, []byte(s.Filter)); err != nil {
				break
			}
			if p.Type == Subscribe {
				if s.QoS > 2 {
					return dst, fmt.Errorf("%w: subscription qos %d", ErrInvalid, s.QoS)
				}
				body = append(body, s.QoS)
			}
		}
	case Suback:
		if len(p.ReturnCodes) == 0 {
			return dst, fmt.Errorf("%w: no return codes", ErrInvalid)
		}
		body = append(body, byte(p.PacketID>>8), byte(p.PacketID))
		body = append(body, p.ReturnCodes...)
	default:
		return dst, fmt.Errorf("%w: type %d", ErrInvalid, p.Type)
	}
	if err != nil {
		return dst, err
	}
	if len(body) > MaxRemainingLength {
		return dst, fmt.Errorf("%w: body of %d bytes", ErrInvalid, len(body))
	}
	dst = append(dst, p.Type<<4|requiredFlags(p.Type))
	dst = AppendVarint(dst, len(body))
	return append(dst, body...), nil
}

func appendConnectBody(b []byte, p *Packet) ([]byte, error) {
	if p.WillQoS > 2 || (!p.Will && (p.WillQoS != 0 || p.WillRetain)) || (p.HasPassword && !p.HasUsername) {
		return nil, fmt.Errorf("%w: connect flags", ErrInvalid)
	}
	var flags byte
	if p.CleanSession {
		flags |= connFlagClean
	}
	if p.Will {
		flags |= connFlagWill | p.WillQoS<<3
		if p.WillRetain {
			flags |= connFlagWillRetain
		}
	}
	if p.HasUsername {
		flags |= connFlagUsername
	}
	if p.HasPassword {
		flags |= connFlagPassword
	}
	var err error
	if b, err = appendString(b, []byte(p.ProtocolName)); err != nil {
		return nil, err
	}
	b = append(b, p.ProtocolLevel, flags, byte(p.KeepAlive>>8), byte(p.KeepAlive))
	fields := [][]byte{[]byte(p.ClientID)}
	if p.Will {
		fields = append(fields, []byte(p.WillTopic), p.WillPayload)
	}
	if p.HasUsername {
		fields = append(fields, []byte(p.Username))
	}
	if p.HasPassword {
		fields = append(fields, p.Password)
	}
	for _, f := range fields {
		if b, err = appendString(b, f); err != nil {
			return nil, err
		}
	}
	return b, nil
}

func appendString(b, s []byte) ([]byte, error) {
	if len(s) > math.MaxUint16 {
		return b, fmt.Errorf("%w: string of %d bytes", ErrInvalid, len(s))
	}
	b = append(b, byte(len(s)>>8), byte(len(s)))
	return append(b, s...), nil
}
