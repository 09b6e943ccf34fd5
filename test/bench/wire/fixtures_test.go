package wire

// fixture is one wire-format example shared by the round-trip tests, the
// reader tests and the fuzz seed corpus (mochi packets/tpackets.go style).
type fixture struct {
	name   string
	raw    []byte
	packet Packet
}

var fixtures = []fixture{
	{
		name: "connect_minimal",
		raw: []byte{0x10, 14, 0, 4, 'M', 'Q', 'T', 'T', 4, 0x02, 0, 60,
			0, 2, 'c', '1'},
		packet: Packet{Type: Connect, ProtocolName: "MQTT", ProtocolLevel: 4,
			CleanSession: true, KeepAlive: 60, ClientID: "c1"},
	},
	{
		name: "connect_full",
		raw: []byte{0x10, 33, 0, 4, 'M', 'Q', 'T', 'T', 4, 0xee, 0, 10,
			0, 1, 'c',
			0, 3, 'w', '/', 't',
			0, 2, 'h', 'i',
			0, 4, 'u', 's', 'e', 'r',
			0, 3, 'p', 'w', 0},
		packet: Packet{Type: Connect, ProtocolName: "MQTT", ProtocolLevel: 4,
			CleanSession: true, KeepAlive: 10, ClientID: "c",
			Will: true, WillQoS: 1, WillRetain: true, WillTopic: "w/t", WillPayload: []byte("hi"),
			HasUsername: true, Username: "user", HasPassword: true, Password: []byte{'p', 'w', 0}},
	},
	{
		name:   "connack_accepted",
		raw:    []byte{0x20, 2, 0, 0},
		packet: Packet{Type: Connack},
	},
	{
		name:   "connack_session_present_refused",
		raw:    []byte{0x20, 2, 1, 5},
		packet: Packet{Type: Connack, SessionPresent: true, ReturnCode: 5},
	},
	{
		name:   "publish_qos0",
		raw:    []byte{0x30, 7, 0, 3, 'a', '/', 'b', 'h', 'i'},
		packet: Packet{Type: Publish, Topic: []byte("a/b"), Payload: []byte("hi")},
	},
	{
		name:   "publish_qos0_empty_payload_retain",
		raw:    []byte{0x31, 3, 0, 1, 'x'},
		packet: Packet{Type: Publish, Retain: true, Topic: []byte("x")},
	},
	{
		name:   "publish_qos1",
		raw:    []byte{0x32, 6, 0, 1, 't', 0x12, 0x34, 'p'},
		packet: Packet{Type: Publish, QoS: 1, PacketID: 0x1234, Topic: []byte("t"), Payload: []byte("p")},
	},
	{
		name:   "publish_qos2_dup",
		raw:    []byte{0x3c, 5, 0, 1, 't', 0, 7},
		packet: Packet{Type: Publish, QoS: 2, Dup: true, PacketID: 7, Topic: []byte("t")},
	},
	{name: "puback", raw: []byte{0x40, 2, 0, 1}, packet: Packet{Type: Puback, PacketID: 1}},
	{name: "pubrec", raw: []byte{0x50, 2, 0xff, 0xff}, packet: Packet{Type: Pubrec, PacketID: 0xffff}},
	{name: "pubrel", raw: []byte{0x62, 2, 1, 0}, packet: Packet{Type: Pubrel, PacketID: 256}},
	{name: "pubcomp", raw: []byte{0x70, 2, 0, 9}, packet: Packet{Type: Pubcomp, PacketID: 9}},
	{
		name: "subscribe_two_filters",
		raw:  []byte{0x82, 14, 0, 5, 0, 3, 'a', '/', '#', 1, 0, 3, '+', '/', 'b', 2},
		packet: Packet{Type: Subscribe, PacketID: 5, Subscriptions: []Subscription{
			{Filter: "a/#", QoS: 1}, {Filter: "+/b", QoS: 2}}},
	},
	{
		name:   "suback",
		raw:    []byte{0x90, 4, 0, 5, 1, 0x80},
		packet: Packet{Type: Suback, PacketID: 5, ReturnCodes: []byte{1, 0x80}},
	},
	{
		name:   "unsubscribe",
		raw:    []byte{0xa2, 5, 0, 6, 0, 1, 'a'},
		packet: Packet{Type: Unsubscribe, PacketID: 6, Subscriptions: []Subscription{{Filter: "a"}}},
	},
	{name: "unsuback", raw: []byte{0xb0, 2, 0, 6}, packet: Packet{Type: Unsuback, PacketID: 6}},
	{name: "pingreq", raw: []byte{0xc0, 0}, packet: Packet{Type: Pingreq}},
	{name: "pingresp", raw: []byte{0xd0, 0}, packet: Packet{Type: Pingresp}},
	{name: "disconnect", raw: []byte{0xe0, 0}, packet: Packet{Type: Disconnect}},
}

// malformed are inputs Decode must reject with ErrMalformed.
var malformed = []struct {
	name string
	raw  []byte
}{
	{"reserved_type_0", []byte{0x00, 0}},
	{"reserved_type_15", []byte{0xf0, 0}},
	{"length_over_4_bytes", []byte{0x30, 0xff, 0xff, 0xff, 0xff, 0x01}},
	{"puback_flags", []byte{0x41, 2, 0, 1}},
	{"pubrel_flags_zero", []byte{0x60, 2, 0, 1}},
	{"subscribe_flags_zero", []byte{0x80, 6, 0, 1, 0, 1, 'a', 0}},
	{"publish_qos3", []byte{0x36, 5, 0, 1, 't', 0, 1}},
	{"publish_qos0_dup", []byte{0x38, 3, 0, 1, 't'}},
	{"publish_qos1_id_zero", []byte{0x32, 5, 0, 1, 't', 0, 0}},
	{"publish_topic_overruns", []byte{0x30, 3, 0, 9, 't'}},
	{"publish_qos1_no_id", []byte{0x32, 3, 0, 1, 't'}},
	{"puback_long", []byte{0x40, 3, 0, 1, 0}},
	{"connack_bad_flags", []byte{0x20, 2, 2, 0}},
	{"pingreq_with_body", []byte{0xc0, 1, 0}},
	{"subscribe_no_filters", []byte{0x82, 2, 0, 1}},
	{"subscribe_qos3", []byte{0x82, 6, 0, 1, 0, 1, 'a', 3}},
	{"subscribe_truncated_filter", []byte{0x82, 5, 0, 1, 0, 2, 'a'}},
	{"suback_bad_code", []byte{0x90, 3, 0, 1, 3}},
	{"connect_reserved_flag", []byte{0x10, 12, 0, 4, 'M', 'Q', 'T', 'T', 4, 0x03, 0, 0, 0, 0}},
	{"connect_password_without_user", []byte{0x10, 14, 0, 4, 'M', 'Q', 'T', 'T', 4, 0x42, 0, 0, 0, 0, 0, 0}},
	{"connect_will_qos_without_will", []byte{0x10, 12, 0, 4, 'M', 'Q', 'T', 'T', 4, 0x0a, 0, 0, 0, 0}},
	{"connect_trailing_bytes", []byte{0x10, 13, 0, 4, 'M', 'Q', 'T', 'T', 4, 0x02, 0, 0, 0, 0, 9}},
}
