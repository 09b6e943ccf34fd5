package broker

// A goroutine starts with a 2 KiB stack and doubles it when a call does not
// fit: the runtime copies the stack and adjusts every frame on it, which
// costs in proportion to how deep the call is. A connection's goroutines
// grow deep in (mochi's packet handling, the hooks), so in a connection
// storm 22% of the edge's CPU went to growing stacks (newstack, copystack).
// Grown first thing, while only a frame or two is on the stack, the same
// growth is a small copy. The runtime's own remedy (starting goroutines at
// the average stack size it saw) is measured at GC, which the heap floor
// makes rare in a storm.
//
// The sizes are what each goroutine reaches anyway, so memory stays as it
// was (idle-10000: 13.2 KB per client either way; an 8 KiB read loop made
// it 17.5 KB). BenchmarkBroker_Connect/method=anonymous: 12.8k → 14.5k
// connects/s (medians of 6); storms of 5,000 clients on a fresh edge, three
// series of 6–8 each way: 55–62 → 47–53 µs of edge CPU per connect.

// growStackForConnect grows the stack of a connection's first goroutine,
// which reads the CONNECT and runs the connect hooks, to 16 KiB; it ends
// once the client is connected (serveDetached).
//
//go:noinline
func growStackForConnect() byte {
	var pad [12 << 10]byte
	return pad[padIndex]
}

// growStackForServe grows the stack of a connection's read loop to 4 KiB,
// the size it reaches waiting for the client's first packet after
// CONNECT, and keeps through PINGREQs and acknowledgements. Not more: a
// PUBLISH grows it to 8 KiB, but a client that only subscribes and pings
// would hold the larger stack for nothing, and a 16 KiB start was slower
// in storms (54 against 48 µs per connect).
//
//go:noinline
func growStackForServe() byte {
	var pad [2560]byte // with the guard the runtime keeps, it fits 4 KiB
	return pad[padIndex]
}

// growStackForWrite grows the stack of a session's writer to 8 KiB. A
// writer runs while a session has messages to send and ends when its queue
// is empty, so under load one starts for nearly every burst, and grew its
// stack twice on the way to the socket write.
//
//go:noinline
func growStackForWrite() byte {
	var pad [6 << 10]byte
	return pad[padIndex]
}

// padIndex is a variable so that the compiler keeps the pads.
var padIndex = 0
