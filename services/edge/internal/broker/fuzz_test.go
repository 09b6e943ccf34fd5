package broker

import (
	"bytes"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

var (
	fuzzOnce sync.Once
	fuzzAddr string
)

// FuzzBroker_PacketPath sends arbitrary bytes after a valid CONNECT and
// checks that the broker neither crashes nor stops serving other clients.
// The seeds cover every packet type, truncations and hostile lengths.
func FuzzBroker_PacketPath(f *testing.F) {
	for _, seed := range fuzzSeeds() {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fuzzOnce.Do(func() {
			// One broker for the whole fuzz run; it lives until the process exits.
			_, fuzzAddr = startBrokerForFuzz(t)
		})
		c := mqtttest.Dial(t, fuzzAddr, 5)
		c.Connect("", true, packets.Properties{})
		_, _ = c.Conn.Write(data)
		// Drain whatever the broker answers until it closes or goes quiet.
		for {
			if _, err := c.Read(20 * time.Millisecond); err != nil {
				break
			}
		}
		_ = c.Conn.Close()

		// The broker still serves a well-behaved pair of clients.
		sub := mqtttest.Dial(t, fuzzAddr, 4)
		sub.Connect("", true, packets.Properties{})
		sub.Subscribe(1, "health", 1)
		pub := mqtttest.Dial(t, fuzzAddr, 4)
		pub.Connect("", true, packets.Properties{})
		pub.Publish(1, "health", 1, []byte("ok"))
		pub.Expect(packets.Puback)
		if got := sub.Expect(packets.Publish); !bytes.Equal(got.Payload, []byte("ok")) {
			t.Fatalf("health message: %q", got.Payload)
		}
	})
}

func startBrokerForFuzz(t *testing.T) (*Broker, string) {
	// Not startBroker: its cleanup would stop the shared broker after the
	// first input.
	cfg := DefaultConfig()
	cfg.EdgeID = "fuzz"
	cfg.ConnectTimeout = time.Second
	b, err := New(cfg, anonymous(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	l := newTCP("127.0.0.1:0")
	if err := b.AddListener(l); err != nil {
		t.Fatal(err)
	}
	if err := b.Serve(); err != nil {
		t.Fatal(err)
	}
	return b, l.Address()
}

func fuzzSeeds() [][]byte {
	enc := func(pk packets.Packet) []byte {
		pk.ProtocolVersion = 5
		var buf bytes.Buffer
		switch pk.FixedHeader.Type {
		case packets.Publish:
			_ = pk.PublishEncode(&buf)
		case packets.Subscribe:
			_ = pk.SubscribeEncode(&buf)
		case packets.Unsubscribe:
			_ = pk.UnsubscribeEncode(&buf)
		case packets.Puback:
			_ = pk.PubackEncode(&buf)
		case packets.Pubrel:
			_ = pk.PubrelEncode(&buf)
		case packets.Disconnect:
			_ = pk.DisconnectEncode(&buf)
		}
		return buf.Bytes()
	}
	pub := enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, PacketID: 1, TopicName: "a/b", Payload: []byte("x"),
		Properties: packets.Properties{TopicAlias: 1, TopicAliasFlag: true, User: []packets.UserProperty{{Key: "k", Val: "v"}}}})
	sub := enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 2,
		Filters: packets.Subscriptions{{Filter: "$share/g/a/#", Qos: 2}, {Filter: "#", NoLocal: true}}})
	return [][]byte{
		pub,
		pub[:len(pub)-2],
		sub,
		enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2}, PacketID: 3, TopicName: "a/+"}),
		enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: "$SYS/x"}),
		enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: "", Properties: packets.Properties{TopicAlias: 9, TopicAliasFlag: true}}),
		enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1}, PacketID: 4, Filters: packets.Subscriptions{{Filter: "a/#/b"}}}),
		enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 5, Filters: packets.Subscriptions{{Filter: "$queue/x"}}}),
		enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 77}),
		enc(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ReasonCode: 0x04}),
		{0x10, 0x00},                               // second CONNECT
		{0x30, 0xff, 0xff, 0xff, 0x7f},             // huge remaining length
		{0x30, 0xff, 0xff, 0xff, 0xff},             // malformed varint
		{0xf0, 0x00},                               // reserved type
		{0x82, 0x05, 0x00, 0x01, 0x00, 0x00, 0x00}, // subscribe with empty filter
		{0x30, 0x04, 0x00, 0x02, 0xc0, 0x80},       // overlong UTF-8 in topic
		{0x30, 0x04, 0x00, 0x02, 0x00, 0x00},       // NUL in topic
	}
}

// panicOnUnsubscribe panics while reading any UNSUBSCRIBE: a stand-in for
// a decoder that indexes past the end of a malformed packet, as mochi's
// SUBSCRIBE decoder did (82 05 00 01 00 00 00, a filter without its
// options byte) before it was fixed.
type panicOnUnsubscribe struct{ mqtt.HookBase }

func (h *panicOnUnsubscribe) ID() string { return "panic-on-unsubscribe" }
func (h *panicOnUnsubscribe) Provides(b byte) bool {
	return b == mqtt.OnPacketRead
}
func (h *panicOnUnsubscribe) OnPacketRead(cl *mqtt.Client, pk *packets.Packet) error {
	if pk.FixedHeader.Type == packets.Unsubscribe {
		var none []byte
		_ = none[len(pk.Filters)] // index out of range
	}
	return nil
}

// A packet that makes the connection's goroutine panic while it is read
// closes only the connection it came on, and that client ends as after any
// other error: its will goes out, it is counted as disconnected, and its
// client ID is free again.
func TestBroker_DecoderPanicEndsOnlyItsClient(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	require.NoError(t, b.server.AddHook(&panicOnUnsubscribe{}, nil))
	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("watcher", true, packets.Properties{})
	require.Equal(t, []byte{1}, watcher.Subscribe(1, "gone/#", 1).ReasonCodes)

	c := mqtttest.Dial(t, addr, 5)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: "crasher",
			WillFlag: true, WillTopic: "gone/crasher", WillQos: 1, WillPayload: []byte("bye")}})
	require.Equal(t, packets.CodeSuccess.Code, c.Expect(packets.Connack).ReasonCode)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 1,
		Filters: packets.Subscriptions{{Filter: "a"}}})

	will := watcher.Expect(packets.Publish)
	require.Equal(t, "gone/crasher", will.TopicName)
	require.Equal(t, []byte("bye"), will.Payload)
	require.Equal(t, float64(1), testutil.ToFloat64(b.m.packetErrors.WithLabelValues("decoder_panic")))
	require.Eventually(t, func() bool { return atomic.LoadInt64(&b.server.Info.ClientsConnected) == 1 }, 5*time.Second, 5*time.Millisecond)
	sc, err := b.scope("default")
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, registered := b.server.Clients.Get(sc.ClientID("crasher"))
		return !registered
	}, 5*time.Second, 5*time.Millisecond, "a clean session that ended stays registered")

	// The watcher was not harmed, and the ID connects again.
	again := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, again.Connect("crasher", true, packets.Properties{}).ReasonCode)
	again.Publish(1, "gone/again", 1, []byte("x"))
	again.Expect(packets.Puback)
	require.Equal(t, "gone/again", watcher.Expect(packets.Publish).TopicName)
}

// An idle connected client holds one goroutine, its read loop, on a small
// stack: the connection's first goroutine, whose stack the CONNECT grew,
// ends after CONNACK, and mochi starts no WriteLoop for it
// (third_party/mochi/README.keel.md). Not parallel, so that no other test's
// goroutines come and go while it counts.
func TestBroker_IdleClientHoldsOneSmallGoroutine(t *testing.T) {
	_, addr := startBroker(t, nil)
	settled := func() (goroutines int, stacks uint64) {
		n := runtime.NumGoroutine()
		for range 50 {
			time.Sleep(20 * time.Millisecond)
			if m := runtime.NumGoroutine(); m != n {
				n = m
				continue
			}
			break
		}
		runtime.GC() // shrinks the stacks that can be
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return runtime.NumGoroutine(), ms.StackInuse
	}
	g0, s0 := settled()
	const clients = 500
	for i := range clients {
		c := mqtttest.Dial(t, addr, byte(4+i%2))
		c.Connect(fmt.Sprintf("idle-%d", i), true, packets.Properties{})
	}
	g1, s1 := settled()
	goroutines := float64(g1-g0) / clients
	stack := float64(s1-s0) / clients
	t.Logf("per idle client: %.2f goroutines, %.0f B of stack", goroutines, stack)
	require.InDelta(t, 1.0, goroutines, 0.1)
	require.Less(t, stack, 10*1024.0, "an idle client holds a stack grown by its CONNECT")
}
