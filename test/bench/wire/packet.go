package wire

import (
	"encoding/binary"
	"fmt"
)

// MQTT control packet types (the high nibble of the fixed header).
const (
	Connect     byte = 1
	Connack     byte = 2
	Publish     byte = 3
	Puback      byte = 4
	Pubrec      byte = 5
	Pubrel      byte = 6
	Pubcomp     byte = 7
	Subscribe   byte = 8
	Suback      byte = 9
	Unsubscribe byte = 10
	Unsuback    byte = 11
	Pingreq     byte = 12
	Pingresp    byte = 13
	Disconnect  byte = 14
)

// MaxRemainingLength is the largest remaining length a 4-byte variable
// integer can carry (MQTT 3.1.1 §2.2.3).
const MaxRemainingLength = 268_435_455

// SubackFailure is the SUBACK return code for a refused subscription.
const SubackFailure byte = 0x80

// CONNECT flag bits (MQTT 3.1.1 §3.1.2.3).
const (
	connFlagReserved   = 0x01
	connFlagClean      = 0x02
	connFlagWill       = 0x04
	connFlagWillQoS    = 0x18
	connFlagWillRetain = 0x20
	connFlagPassword   = 0x40
	connFlagUsername   = 0x80
)

// Subscription is one topic filter of a SUBSCRIBE, or of an UNSUBSCRIBE (QoS unused).
type Subscription struct {
	Filter string
	QoS    byte
}

// Packet is any MQTT 3.1.1 control packet, flattened: only the fields of its
// Type are meaningful. Slices returned by [Decode] alias the input buffer.
// Empty byte slices are always nil after decoding, so a decoded packet
// compares equal to the decoding of its own encoding.
type Packet struct {
	Type byte

	// CONNECT.
	ProtocolName  string
	ProtocolLevel byte
	CleanSession  bool
	KeepAlive     uint16
	ClientID      string
	Will          bool
	WillQoS       byte
	WillRetain    bool
	WillTopic     string
	WillPayload   []byte
	HasUsername   bool
	Username      string
	HasPassword   bool
	Password      []byte

	// CONNACK.
	SessionPresent bool
	ReturnCode     byte

	// PUBLISH.
	Dup     bool
	QoS     byte
	Retain  bool
	Topic   []byte
	Payload []byte

	// PUBLISH with QoS > 0, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBSCRIBE, SUBACK,
	// UNSUBSCRIBE, UNSUBACK.
	PacketID uint16

	// SUBSCRIBE, UNSUBSCRIBE.
	Subscriptions []Subscription
	// SUBACK.
	ReturnCodes []byte
}

// requiredFlags is the fixed-header low nibble each non-PUBLISH type must carry.
func requiredFlags(t byte) byte {
	switch t {
	case Pubrel, Subscribe, Unsubscribe:
		return 0x02
	default:
		return 0
	}
}

// AppendVarint appends the MQTT variable byte integer encoding of n.
func AppendVarint(dst []byte, n int) []byte {
	for {
		b := byte(n & 0x7f)
		n >>= 7
		if n > 0 {
			b |= 0x80
		}
		dst = append(dst, b)
		if n == 0 {
			return dst
		}
	}
}

// varintLen is the encoded size of n as a variable byte integer.
func varintLen(n int) int {
	switch {
	case n < 128:
		return 1
	case n < 16_384:
		return 2
	case n < 2_097_152:
		return 3
	default:
		return 4
	}
}

// ParseHeader reads a fixed header from b. It returns the header byte, the
// remaining length and the header size, or [ErrShortBuffer] when b does not
// hold the whole header yet, or [ErrMalformed] for a length longer than 4 bytes.
func ParseHeader(b []byte) (header byte, remaining, size int, err error) {
	if len(b) < 2 {
		return 0, 0, 0, ErrShortBuffer
	}
	mult := 1
	for i := 1; i <= 4; i++ {
		if i >= len(b) {
			return 0, 0, 0, ErrShortBuffer
		}
		c := b[i]
		remaining += int(c&0x7f) * mult
		if c&0x80 == 0 {
			return b[0], remaining, i + 1, nil
		}
		mult <<= 7
	}
	return 0, 0, 0, fmt.Errorf("%w: remaining length over 4 bytes", ErrMalformed)
}

// Decode decodes one packet from the start of b and returns it with the number
// of bytes it used. It returns [ErrShortBuffer] if b holds only part of a packet.
func Decode(b []byte) (Packet, int, error) {
	header, rem, hs, err := ParseHeader(b)
	if err != nil {
		return Packet{}, 0, err
	}
	if len(b)-hs < rem {
		return Packet{}, 0, ErrShortBuffer
	}
	p, err := DecodeBody(header, b[hs:hs+rem])
	if err != nil {
		return Packet{}, 0, err
	}
	return p, hs + rem, nil
}

// DecodeBody decodes a packet from its fixed-header byte and its body (the
// remaining-length bytes after the fixed header).
func DecodeBody(header byte, body []byte) (Packet, error) {
	t, flags := header>>4, header&0x0f
	p := Packet{Type: t}
	if t != Publish && flags != requiredFlags(t) {
		return Packet{}, fmt.Errorf("%w: type %d with flags %#x", ErrMalformed, t, flags)
	}
	d := decoder{b: body}
	switch t {
	case Connect:
		return decodeConnect(body)
	case Connack:
		if len(body) != 2 || body[0]&0xfe != 0 {
			return Packet{}, fmt.Errorf("%w: connack", ErrMalformed)
		}
		p.SessionPresent = body[0] == 1
		p.ReturnCode = body[1]
		return p, nil
	case Publish:
		topic, payload, id, err := DecodePublish(flags, body)
		if err != nil {
			return Packet{}, err
		}
		p.Dup, p.QoS, p.Retain = flags&0x08 != 0, (flags>>1)&0x03, flags&0x01 != 0
		p.Topic, p.Payload, p.PacketID = nilIfEmpty(topic), nilIfEmpty(payload), id
		return p, nil
	case Puback, Pubrec, Pubrel, Pubcomp, Unsuback:
		if len(body) != 2 {
			return Packet{}, fmt.Errorf("%w: ack length %d", ErrMalformed, len(body))
		}
		p.PacketID = binary.BigEndian.Uint16(body)
		return p, nil
	case Subscribe, Unsubscribe:
		p.PacketID = d.u16()
		for d.ok() && len(d.b) > 0 {
			s := Subscription{Filter: string(d.str())}
			if t == Subscribe {
				s.QoS = d.byte()
				if s.QoS > 2 {
					return Packet{}, fmt.Errorf("%w: subscription qos %#x", ErrMalformed, s.QoS)
				}
			}
			p.Subscriptions = append(p.Subscriptions, s)
		}
		if !d.ok() || len(p.Subscriptions) == 0 {
			return Packet{}, fmt.Errorf("%w: (un)subscribe", ErrMalformed)
		}
		return p, nil
	case Suback:
		p.PacketID = d.u16()
		if !d.ok() || len(d.b) == 0 {
			return Packet{}, fmt.Errorf("%w: suback", ErrMalformed)
		}
		for _, c := range d.b {
			if c > 2 && c != SubackFailure {
				return Packet{}, fmt.Errorf("%w: suback code %#x", ErrMalformed, c)
			}
		}
		p.ReturnCodes = d.b
		return p, nil
	case Pingreq, Pingresp, Disconnect:
		if len(body) != 0 {
			return Packet{}, fmt.Errorf("%w: type %d with a body", ErrMalformed, t)
		}
		return p, nil
	default:
		return Packet{}, fmt.Errorf("%w: reserved type %d", ErrMalformed, t)
	}
}

// DecodePublish decodes a PUBLISH body in place: the hot path of the load
// generator. flags is the low nibble of the fixed header. topic and payload
// alias body.
func DecodePublish(flags byte, body []byte) (topic, payload []byte, packetID uint16, err error) {
	qos := (flags >> 1) & 0x03
	if qos == 3 || (qos == 0 && flags&0x08 != 0) {
		return nil, nil, 0, fmt.Errorf("%w: publish flags %#x", ErrMalformed, flags)
	}
	if len(body) < 2 {
		return nil, nil, 0, fmt.Errorf("%w: publish topic", ErrMalformed)
	}
	n := int(binary.BigEndian.Uint16(body)) + 2
	if n > len(body) {
		return nil, nil, 0, fmt.Errorf("%w: publish topic", ErrMalformed)
	}
	topic = body[2:n]
	if qos > 0 {
		if n+2 > len(body) {
			return nil, nil, 0, fmt.Errorf("%w: publish packet id", ErrMalformed)
		}
		packetID = binary.BigEndian.Uint16(body[n:])
		n += 2
		if packetID == 0 {
			return nil, nil, 0, fmt.Errorf("%w: publish packet id 0", ErrMalformed)
		}
	}
	return topic, body[n:], packetID, nil
}

func decodeConnect(body []byte) (Packet, error) {
	d := decoder{b: body}
	p := Packet{Type: Connect}
	p.ProtocolName = string(d.str())
	p.ProtocolLevel = d.byte()
	flags := d.byte()
	p.KeepAlive = d.u16()
	if !d.ok() {
		return Packet{}, fmt.Errorf("%w: connect header", ErrMalformed)
	}
	if flags&connFlagReserved != 0 {
		return Packet{}, fmt.Errorf("%w: connect reserved flag", ErrMalformed)
	}
	p.CleanSession = flags&connFlagClean != 0
	p.Will = flags&connFlagWill != 0
	p.WillQoS = (flags & connFlagWillQoS) >> 3
	p.WillRetain = flags&connFlagWillRetain != 0
	p.HasUsername = flags&connFlagUsername != 0
	p.HasPassword = flags&connFlagPassword != 0
	if p.WillQoS > 2 || (!p.Will && (p.WillQoS != 0 || p.WillRetain)) {
		return Packet{}, fmt.Errorf("%w: connect will flags %#x", ErrMalformed, flags)
	}
	if p.HasPassword && !p.HasUsername { // [MQTT-3.1.2-22]
		return Packet{}, fmt.Errorf("%w: connect password without username", ErrMalformed)
	}
	p.ClientID = string(d.str())
	if p.Will {
		p.WillTopic = string(d.str())
		p.WillPayload = nilIfEmpty(d.str())
	}
	if p.HasUsername {
		p.Username = string(d.str())
	}
	if p.HasPassword {
		p.Password = nilIfEmpty(d.str())
	}
	if !d.ok() || len(d.b) != 0 {
		return Packet{}, fmt.Errorf("%w: connect payload", ErrMalformed)
	}
	return p, nil
}

// decoder reads big-endian fields, latching the first error so a sequence of
// reads needs a single check.
type decoder struct {
	b   []byte
	bad bool
}

func (d *decoder) ok() bool { return !d.bad }

func (d *decoder) byte() byte {
	if d.bad || len(d.b) < 1 {
		d.bad = true
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *decoder) u16() uint16 {
	if d.bad || len(d.b) < 2 {
		d.bad = true
		return 0
	}
	v := binary.BigEndian.Uint16(d.b)
	d.b = d.b[2:]
	return v
}

func (d *decoder) str() []byte {
	n := int(d.u16())
	if d.bad || len(d.b) < n {
		d.bad = true
		return nil
	}
	s := d.b[:n]
	d.b = d.b[n:]
	return s
}

func nilIfEmpty(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return b
}
