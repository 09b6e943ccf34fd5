// Package wire is a minimal, allocation-free MQTT 3.1.1 codec for the Keel load
// generator.
//
// It encodes and decodes every MQTT 3.1.1 control packet (CONNECT through
// DISCONNECT) into a flat [Packet], and offers append-style encoders
// ([AppendPublish], [AppendAck], …) plus a buffered [Reader] and [Writer] for
// the hot path, where a PUBLISH is decoded in place by [DecodePublish] without
// building a [Packet]. It does not implement MQTT 5 properties, and it checks
// only the structural rules a decoder must enforce to stay safe on hostile
// input (lengths, reserved flags, QoS values); it does not validate UTF-8 or
// topic syntax.
//
// Like mochi's packets package, it imports no server code.
package wire
