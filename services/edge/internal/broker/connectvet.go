package broker

import (
	"bytes"
	"unicode/utf8"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/keelmq/keel/libs/topic"
)

// vetConnect checks a CONNECT against section 3.1 of the version it names,
// before mochi validates it: mochi answers some faults with a code the
// client's version does not define (0x82 to an MQTT 3.1.1 client, shown
// to it as 0x03, server unavailable) and lets others through. A refused
// CONNECT is answered here (refuseConnect) and the connection then closed.
// An MQTT 3.1 CONNECT has the flags 3.1 disregards cleared, for mochi's
// validation, which knows only the 3.1.1 rules.
func (b *Broker) vetConnect(cl *mqtt.Client, pk *packets.Packet) error {
	name, level := pk.Connect.ProtocolName, pk.ProtocolVersion
	mqttName, v31Name := bytes.Equal(name, []byte("MQTT")), bytes.Equal(name, []byte("MQIsdp"))
	if !mqttName && !v31Name {
		// [MQTT-3.1.2-1]: a protocol name not of this specification: it
		// MAY disconnect, and must not go on with it as MQTT.
		// The name is the client's, up to 64 KiB: the log gets its start.
		return b.refuseConnect(cl, 0, packets.Code{}, "protocol_name", "protocol", string(name[:min(len(name), 32)]))
	}
	if (v31Name && level != 3) || (mqttName && level != 4 && level != 5) {
		// 3.1.1 [MQTT-3.1.2-2]: CONNACK 0x01 (unacceptable protocol level).
		// MQTT 5 [MQTT-3.1.2-2]: a level other than 5 MAY get 0x84; a level
		// above 5 is answered in the MQTT 5 form, the only later one.
		answer := byte(4)
		if mqttName && level > 5 {
			answer = 5
		}
		return b.refuseConnect(cl, answer, packets.ErrUnsupportedProtocolVersion, "protocol_version", "level", level)
	}
	v5 := level == 5
	if v5 {
		// The CONNACK of a refusal is bound by the Maximum Packet Size the
		// client declared ([MQTT-3.1.2-24]); mochi, not having parsed the
		// CONNECT, knows none. ParseConnect sets it again on acceptance.
		cl.Properties.Props.MaximumPacketSize = pk.Properties.MaximumPacketSize
	}
	if level == 3 {
		// MQTT 3.1 (§3.1, Connect flags): bit 0 is unused, and Will QoS and
		// Will Retain are disregarded without the Will flag; only 3.1.1
		// made them faults ([MQTT-3.1.2-3], [MQTT-3.1.2-13],
		// [MQTT-3.1.2-15]).
		pk.ReservedBit = 0
		if !pk.Connect.WillFlag {
			pk.Connect.WillQos, pk.Connect.WillRetain = 0, false
		}
	}
	// malformed answers a fault of the packet's form: an MQTT 5 client is
	// told 0x81 (Malformed Packet, §4.13); MQTT 3.1.1 and 3.1 define no
	// return code for it, so the connection is closed without a CONNACK
	// (3.1.1 [MQTT-3.1.4-1]).
	malformed := func(why string, args ...any) error {
		if v5 {
			return b.refuseConnect(cl, 5, packets.ErrMalformedPacket, why, args...)
		}
		return b.refuseConnect(cl, 0, packets.Code{}, why, args...)
	}
	if pk.ReservedBit != 0 {
		return malformed("connect_reserved_flag") // [MQTT-3.1.2-3]
	}
	c := &pk.Connect
	if !v5 && c.PasswordFlag && !c.UsernameFlag {
		return malformed("password_without_username") // 3.1.1 [MQTT-3.1.2-22]
	}
	if c.UsernameFlag && (!utf8.Valid(c.Username) || bytes.IndexByte(c.Username, 0) >= 0) {
		// The user name is a UTF-8 encoded string (3.1.1 [MQTT-3.1.3-11],
		// MQTT 5 [MQTT-3.1.3-12]): ill-formed or holding U+0000, it ends
		// the connection (3.1.1 [MQTT-1.5.3-1] [MQTT-1.5.3-2]; MQTT 5
		// [MQTT-1.5.4-1] [MQTT-1.5.4-2], a Malformed Packet).
		return malformed("invalid_username")
	}
	if c.WillFlag && c.WillQos > 2 {
		return malformed("invalid_will_flags", "will_qos", c.WillQos) // 3.1.1 [MQTT-3.1.2-14]; MQTT 5 §3.1.2.6
	}
	if !c.WillFlag && (c.WillQos != 0 || c.WillRetain) {
		return malformed("invalid_will_flags") // 3.1.1 [MQTT-3.1.2-13] [MQTT-3.1.2-15]; MQTT 5 [MQTT-3.1.2-11] [MQTT-3.1.2-13]
	}
	if c.ClientIdentifier == "" && (level == 3 || !c.Clean) {
		// MQTT 3.1 (§3.1, Client Identifier): 1 to 23 characters, else
		// return code 2; a server assigns one only from 3.1.1 on
		// ([MQTT-3.1.3-6]), and for a clean session only ([MQTT-3.1.3-8]).
		// MQTT 5 assigns one whatever Clean Start says ([MQTT-3.1.3-6]).
		if !v5 {
			return b.refuseConnect(cl, 4, packets.ErrClientIdentifierNotValid, "invalid_client_id", "level", level)
		}
	}
	if c.WillFlag {
		if err := topic.ValidateName(c.WillTopic, b.limits); err != nil {
			// MQTT 5: 0x90 (Topic Name invalid). 3.1.1 has no return code for
			// a will topic it refuses, so it closes ([MQTT-3.2.2-6]); an empty
			// or wildcard one is a protocol violation besides ([MQTT-4.7.3-1],
			// [MQTT-4.7.1-1]).
			if v5 {
				return b.refuseConnect(cl, 5, packets.ErrTopicNameInvalid, "invalid_will_topic", "error", err)
			}
			return b.refuseConnect(cl, 0, packets.Code{}, "invalid_will_topic", "error", err)
		}
		if v5 && c.WillRetain && b.cfg.RetainDisabled {
			// The CONNACK would say Retain Available 0 [MQTT-3.2.2-13]. A
			// 3.1.1 client cannot be told: its will goes out, not retained.
			return b.refuseConnect(cl, 5, packets.ErrRetainNotSupported, "retain_not_supported")
		}
	}
	return nil
}

// refuseConnect refuses the CONNECT read on cl: it counts and logs it and,
// unless answer is 0, writes a CONNACK with code in the form of protocol
// version answer (5, or 4 for the 3.1.1 and 3.1 return codes). The caller
// returns the error, and mochi closes the connection.
func (b *Broker) refuseConnect(cl *mqtt.Client, answer byte, code packets.Code, why string, args ...any) error {
	b.m.packetErrors.WithLabelValues(why).Inc()
	b.m.connects.WithLabelValues("invalid_connect").Inc()
	b.logger.Info("connect refused", append([]any{"reason", why, "remote", cl.Net.Remote, "connack", answer != 0, "code", code.Code}, args...)...)
	if answer == 0 {
		return packets.ErrProtocolViolation
	}
	// mochi has not parsed the CONNECT yet: the version chooses the
	// CONNACK's form (and, for 3.x, maps code to its return code).
	cl.Properties.ProtocolVersion = answer
	_ = b.server.SendConnack(cl, code, false, nil)
	return code
}
