package wire

import "errors"

// ErrShortBuffer means the input ends before the packet does; read more and retry.
var ErrShortBuffer = errors.New("wire: short buffer")

// ErrMalformed means the bytes are not a valid MQTT 3.1.1 packet.
var ErrMalformed = errors.New("wire: malformed packet")

// ErrTooLarge means a packet is larger than the configured or protocol maximum.
var ErrTooLarge = errors.New("wire: packet too large")

// ErrInvalid means a [Packet] cannot be encoded because a field is out of range.
var ErrInvalid = errors.New("wire: invalid packet")
