package broker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// heldPeers stands in for the other edges: every QoS 1/2 forward waits
// until the test answers it, in whatever order the test picks.
type heldPeers struct {
	mu      sync.Mutex
	pending map[string]chan error // payload → answer
	routed  map[string]int
}

func newHeldPeers() *heldPeers {
	return &heldPeers{pending: map[string]chan error{}, routed: map[string]int{}}
}

func (p *heldPeers) ForwardShared(context.Context, *Message, GroupKey, string) (func() error, error) {
	return nil, ErrNoMember
}

func (p *heldPeers) Relay(context.Context, *Message, string, []RelayTarget) (func() error, error) {
	return nil, errors.New("no relays here")
}

func (p *heldPeers) Forward(ctx context.Context, m *Message, _ *Again) (func() error, SharedChoice, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	key := string(m.Payload)
	p.routed[key]++
	if m.QoS == 0 {
		return nil, SharedChoice{}, nil
	}
	c := make(chan error, 1)
	p.pending[key] = c
	return func() error {
		select {
		case err := <-c:
			return err
		case <-ctx.Done():
			return ctx.Err()
		}
	}, SharedChoice{}, nil
}

func (p *heldPeers) answer(t *testing.T, key string, err error) {
	t.Helper()
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.pending[key] != nil
	}, 5*time.Second, time.Millisecond, "forward of %q", key)
	p.mu.Lock()
	c := p.pending[key]
	p.mu.Unlock()
	c <- err
}

func (p *heldPeers) routes(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.routed[key]
}

// expectNothing fails if a packet arrives within d.
func expectNothing(t *testing.T, c *mqtttest.Client, d time.Duration) {
	t.Helper()
	pk, err := c.Read(d)
	require.Error(t, err, "unexpected packet type %d id %d", pk.FixedHeader.Type, pk.PacketID)
}

// Acknowledgements wait for the other edges without holding up the
// publisher's next PUBLISH, and leave in the order the PUBLISHes came even
// when the peers answer out of order.
func TestBroker_DeferredAcksInOrder(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	peers := newHeldPeers()
	b.SetCluster(Cluster{Peers: peers})

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t", 1, []byte("m1"))
	pub.Publish(2, "t", 2, []byte("m2"))
	pub.Publish(3, "t", 1, []byte("m3"))
	// Every message was routed while none was acknowledged.
	require.Eventually(t, func() bool { return peers.routes("m3") == 1 }, 5*time.Second, time.Millisecond)

	peers.answer(t, "m3", nil)
	peers.answer(t, "m2", nil)
	expectNothing(t, pub, 100*time.Millisecond) // m1 still waits
	// A QoS 2 PUBLISH sent again before its PUBREC is not routed twice.
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2, Dup: true}, PacketID: 2, TopicName: "t", Payload: []byte("m2")})
	peers.answer(t, "m1", nil)

	require.Equal(t, uint16(1), pub.Expect(packets.Puback).PacketID)
	rec := pub.Expect(packets.Pubrec)
	require.Equal(t, uint16(2), rec.PacketID)
	require.Equal(t, uint16(3), pub.Expect(packets.Puback).PacketID)
	require.Equal(t, 1, peers.routes("m2"))

	// The QoS 2 flow completes through mochi's in-flight store.
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: 2})
	comp := pub.Expect(packets.Pubcomp)
	require.Equal(t, packets.CodeSuccess.Code, comp.ReasonCode)

	// A publish with nothing to wait for is acknowledged at once again.
	b.SetCluster(Cluster{Peers: &heldPeers{pending: map[string]chan error{}, routed: map[string]int{}}})
	pub.Publish(4, "t", 0, []byte("m4"))
	pub.Publish(5, "t", 1, []byte("m5"))
	peers2 := b.cluster.Peers.(*heldPeers)
	peers2.answer(t, "m5", nil)
	require.Equal(t, uint16(5), pub.Expect(packets.Puback).PacketID)
}

// When a peer does not take a message, neither it nor anything published
// after it is acknowledged: the publisher is disconnected and sends them
// again on its next connection.
func TestBroker_DeferredAckFailure(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	peers := newHeldPeers()
	b.SetCluster(Cluster{Peers: peers})

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "t", 1, []byte("a"))
	pub.Publish(2, "t", 1, []byte("b"))
	peers.answer(t, "b", nil)
	peers.answer(t, "a", errors.New("peer gone"))
	require.Equal(t, packets.ErrServerBusy.Code, pub.Expect(packets.Disconnect).ReasonCode)
}

// An MQTT 5 client that exceeds the edge's Receive Maximum with publishes
// awaiting acknowledgement is disconnected with 0x93 [MQTT-3.3.4-8].
func TestBroker_DeferredAcksReceiveMaximum(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, func(c *Config) { c.ReceiveMaximum = 2 })
	peers := newHeldPeers()
	b.SetCluster(Cluster{Peers: peers})
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	for i := range 3 {
		pub.Publish(uint16(i+1), "t", 1, []byte{'x', byte('0' + i)})
	}
	require.Equal(t, packets.ErrReceiveMaximum.Code, pub.Expect(packets.Disconnect).ReasonCode)
}

// An MQTT 3.1.1 client has no Receive Maximum: past the edge's window its
// reads wait until the oldest publish is acknowledged.
func TestBroker_DeferredAcksHoldMQTT3(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, func(c *Config) { c.ReceiveMaximum = 2 })
	peers := newHeldPeers()
	b.SetCluster(Cluster{Peers: peers})
	pub := mqtttest.Dial(t, addr, 4)
	pub.Connect("pub", true, packets.Properties{})
	for i := range 3 {
		pub.Publish(uint16(i+1), "t", 1, []byte{'x', byte('0' + i)})
	}
	require.Eventually(t, func() bool { return peers.routes("x1") == 1 }, 5*time.Second, time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	require.Zero(t, peers.routes("x2"), "third publish read while two wait")
	peers.answer(t, "x0", nil)
	require.Equal(t, uint16(1), pub.Expect(packets.Puback).PacketID)
	peers.answer(t, "x1", nil)
	peers.answer(t, "x2", nil)
	require.Equal(t, uint16(2), pub.Expect(packets.Puback).PacketID)
	require.Equal(t, uint16(3), pub.Expect(packets.Puback).PacketID)
}

// A QoS 2 PUBLISH that not every recipient took is not acknowledged, and
// its stored PUBREC state goes: when the client resumes its session (here
// after a restart of the edge) and sends it again, it is routed again
// rather than answered as a duplicate of a message that was never taken.
func TestBroker_FailedQoS2PublishIsRoutedAgainAfterResume(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	b, addr, stop := openDurable(t, dir)
	peers := newHeldPeers()
	b.SetCluster(Cluster{Peers: peers})
	pub := mqtttest.Dial(t, addr, 4)
	require.False(t, pub.Connect("pub", false, packets.Properties{}).SessionPresent)
	pub.Publish(7, "t", 2, []byte("once"))
	peers.answer(t, "once", errors.New("peer gone"))
	for {
		pk, err := pub.Read(5 * time.Second)
		if err != nil {
			break // closed without a PUBREC
		}
		require.NotEqual(t, packets.Pubrec, pk.FixedHeader.Type, "not every recipient took it: no PUBREC")
	}
	// At once: the edge's stop waits for the PUBREC state to go.
	stop()

	_, addr, stop = openDurable(t, dir)
	t.Cleanup(stop)
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("sub", true, packets.Properties{})
	require.Equal(t, []byte{2}, sub.Subscribe(1, "t", 2).ReasonCodes)
	pub = mqtttest.Dial(t, addr, 4)
	require.True(t, pub.Connect("pub", false, packets.Properties{}).SessionPresent)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2, Dup: true}, PacketID: 7,
		TopicName: "t", Payload: []byte("once")})
	require.Equal(t, uint16(7), pub.Expect(packets.Pubrec).PacketID)
	require.Equal(t, "once", string(sub.Expect(packets.Publish).Payload), "routed again")
}

// lookupPeers stands in for the other edges where topics ending in "/slow"
// need a Lookup at the router: Forward blocks on them until released.
type lookupPeers struct {
	heldPeers
	release chan struct{}
	fail    error // what the slow lookup ends with
	mu2     sync.Mutex
	order   []string // payloads in the order Forward was called
}

func (p *lookupPeers) Forward(ctx context.Context, m *Message, _ *Again) (func() error, SharedChoice, error) {
	if strings.HasSuffix(m.Topic, "/slow") && IsAtOnce(ctx) {
		return nil, SharedChoice{}, ErrNeedsLookup
	}
	if strings.HasSuffix(m.Topic, "/slow") && string(m.Payload) == "s1" {
		<-p.release
		if p.fail != nil {
			return nil, SharedChoice{}, p.fail
		}
	}
	p.mu2.Lock()
	p.order = append(p.order, string(m.Payload))
	p.mu2.Unlock()
	return nil, SharedChoice{}, nil
}

func (p *lookupPeers) forwarded() []string {
	p.mu2.Lock()
	defer p.mu2.Unlock()
	return slices.Clone(p.order)
}

// A publish whose routes need a call to the router does not hold up the
// publisher's other topics: they are routed meanwhile, while a later
// publish on its topic waits behind it, and the acknowledgements still
// leave in the order of the PUBLISHes.
func TestBroker_LookupHoldsUpOnlyItsTopic(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	peers := &lookupPeers{release: make(chan struct{})}
	release := sync.OnceFunc(func() { close(peers.release) })
	t.Cleanup(release) // a failing test does not leave the read loop stuck
	b.SetCluster(Cluster{Peers: peers})

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "a/slow", 1, []byte("s1"))
	pub.Publish(2, "b/fast", 1, []byte("f1"))
	pub.Publish(3, "a/slow", 1, []byte("s2"))
	pub.Publish(4, "c/fast", 1, []byte("f2"))
	require.Eventually(t, func() bool { return len(peers.forwarded()) == 2 }, 5*time.Second, time.Millisecond)
	require.Equal(t, []string{"f1", "f2"}, peers.forwarded(), "other topics go on; s2 waits behind s1")
	expectNothing(t, pub, 100*time.Millisecond) // s1's PUBACK comes first

	release()
	for id := uint16(1); id <= 4; id++ {
		require.Equal(t, id, pub.Expect(packets.Puback).PacketID)
	}
	require.Equal(t, []string{"f1", "f2", "s1", "s2"}, peers.forwarded(), "the slow topic in its order")
}

// slowTopicBehindLookup has a client publish s1 and s2 on a topic whose
// routes need a lookup, then f1 on one whose routes are known, and waits
// until f1 was routed. The lookup ends, failing with fail, when release is
// called.
func slowTopicBehindLookup(t *testing.T, fail error) (*Broker, *mqtttest.Client, *lookupPeers, func()) {
	t.Helper()
	b, addr := startBroker(t, nil)
	peers := &lookupPeers{release: make(chan struct{}), fail: fail}
	release := sync.OnceFunc(func() { close(peers.release) })
	t.Cleanup(release) // a failing test does not leave the lookup stuck
	b.SetCluster(Cluster{Peers: peers})
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(1, "a/slow", 1, []byte("s1"))
	pub.Publish(2, "a/slow", 1, []byte("s2"))
	pub.Publish(3, "b/fast", 1, []byte("f1"))
	require.Eventually(t, func() bool { return len(peers.forwarded()) == 1 }, 5*time.Second, time.Millisecond)
	return b, pub, peers, release
}

// A publish whose lookup fails is not acknowledged (the publisher is
// disconnected and sends it again), and the publishes behind it on its
// topic are not routed either: they would reach subscribers before it.
func TestBroker_FailedLookupHoldsBackItsTopic(t *testing.T) {
	t.Parallel()
	_, pub, peers, release := slowTopicBehindLookup(t, errors.New("router unreachable"))
	release()
	for {
		pk, err := pub.Read(5 * time.Second)
		if err != nil {
			break // disconnected
		}
		require.NotEqual(t, packets.Puback, pk.FixedHeader.Type, "nothing is acknowledged after the failed publish")
	}
	require.Equal(t, []string{"f1"}, peers.forwarded(), "s2 is not routed ahead of s1's resend")
}

// Publishes waiting behind a lookup when the publisher's connection closes
// are not routed: read on the read loop, they would not have been either,
// and the client sends them again on its next connection, where routed
// late they would follow its resends.
func TestBroker_LookupChainEndsWithItsConnection(t *testing.T) {
	t.Parallel()
	b, pub, peers, release := slowTopicBehindLookup(t, nil)
	require.NoError(t, pub.Conn.Close())
	id := b.mustScope(t, "default").ClientID("pub")
	require.Eventually(t, func() bool { cl, on := b.server.Clients.Get(id); return !on || cl.Closed() }, 5*time.Second, time.Millisecond)
	release()
	require.Eventually(t, func() bool { return len(peers.forwarded()) == 2 }, 5*time.Second, time.Millisecond)
	time.Sleep(100 * time.Millisecond)
	require.Equal(t, []string{"f1", "s1"}, peers.forwarded(), "s1 was being routed; s2, behind it, is not")
}

// writesConn records each Write; the first one blocks until released.
type writesConn struct {
	net.Conn
	mu      sync.Mutex
	writes  [][]byte
	first   chan struct{} // closed: writes go through
	blocked chan struct{} // closed once the first write is waiting
	once    sync.Once
}

func (c *writesConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.writes = append(c.writes, slices.Clone(p))
	n := len(c.writes)
	c.mu.Unlock()
	if n == 1 {
		c.once.Do(func() { close(c.blocked) })
		<-c.first
	}
	return len(p), nil
}

// Acknowledgements that are ready while an earlier write is on its way
// leave in one write, in the order of the PUBLISHes.
func TestAcks_ReadyTogetherWrittenTogether(t *testing.T) {
	t.Parallel()
	b, _ := startBroker(t, nil)
	end, _ := net.Pipe() // for its addresses: writes go to wc
	wc := &writesConn{Conn: end, first: make(chan struct{}), blocked: make(chan struct{})}
	cl := b.server.NewClient(wc, "test", "pub", false)
	cl.Properties.ProtocolVersion = 5
	c := &conn{}
	const n = 20
	// The first publish waits for the others to be queued: then every
	// acknowledgement is ready at once.
	gate := make(chan struct{})
	for i := range n {
		var wait func() error
		if i == 0 {
			wait = func() error { <-gate; return nil }
		}
		b.queueAck(cl, c, &packets.Packet{PacketID: uint16(i + 1), FixedHeader: packets.FixedHeader{Qos: 1}}, wait, false, nil, nil)
	}
	close(gate)
	<-wc.blocked // the first write is on its way
	// Every acknowledgement is gathered for a write, held at the first.
	testutil.Eventually(t, 5*time.Second, func() error {
		c.acks.mu.Lock()
		defer c.acks.mu.Unlock()
		if c.acks.handed < n {
			return fmt.Errorf("%d of %d gathered", c.acks.handed, n)
		}
		return nil
	})
	close(wc.first)
	testutil.Eventually(t, 5*time.Second, func() error {
		if !c.acks.idle() {
			return errors.New("acknowledgements pending")
		}
		return nil
	})
	wc.mu.Lock()
	defer wc.mu.Unlock()
	// A write takes what is gathered when it goes: all twenty, or the
	// first ones and then, once that write is done, the rest. One write per
	// acknowledgement would be twenty.
	require.LessOrEqual(t, len(wc.writes), 2, "acknowledgements ready together leave together")
	var ids []uint16
	for _, w := range wc.writes {
		for len(w) > 0 {
			require.Equal(t, byte(packets.Puback<<4), w[0])
			require.Equal(t, byte(2), w[1])
			ids = append(ids, uint16(w[2])<<8|uint16(w[3]))
			w = w[4:]
		}
	}
	want := make([]uint16, n)
	for i := range want {
		want[i] = uint16(i + 1)
	}
	require.Equal(t, want, ids)
}

// writeCountingListener counts the writes to the connections it accepts.
type writeCountingListener struct {
	listeners.Listener
	writes atomic.Int64
}

func (l *writeCountingListener) Serve(establish listeners.EstablishFn) {
	l.Listener.Serve(func(id string, c net.Conn) error {
		return establish(id, &writeCountingConn{Conn: c, writes: &l.writes})
	})
}

type writeCountingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c *writeCountingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// The acknowledgements of PUBLISHes read together leave together, in the
// order of the PUBLISHes [MQTT-4.6.0-2] [MQTT-4.6.0-3], not one write each
// (heldAcks). A DISCONNECT read right after them closes the connection
// only once they are written.
func TestBroker_AcksOfPublishesReadTogetherLeaveTogether(t *testing.T) {
	t.Parallel()
	for _, version := range []byte{4, 5} {
		t.Run(fmt.Sprintf("v%d", version), func(t *testing.T) {
			t.Parallel()
			b, err := New(DefaultConfig(), anonymous(), testutil.Logger(t), prometheus.NewRegistry())
			require.NoError(t, err)
			l := &writeCountingListener{Listener: newTCP("127.0.0.1:0")}
			require.NoError(t, b.AddListener(l))
			require.NoError(t, b.Serve())
			t.Cleanup(func() { _ = b.Close() })
			c := mqtttest.Dial(t, l.Address(), version)
			c.Connect("batch", true, packets.Properties{})

			const n = 60
			var out bytes.Buffer
			for i := 1; i <= n; i++ {
				pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: byte(1 + i%2)},
					TopicName: "batch/t", PacketID: uint16(i), Payload: []byte("x"), ProtocolVersion: version}
				require.NoError(t, pk.PublishEncode(&out))
			}
			disconnect := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ProtocolVersion: version}
			require.NoError(t, disconnect.DisconnectEncode(&out))
			before := l.writes.Load()
			_, err = c.Conn.Write(out.Bytes())
			require.NoError(t, err)
			for i := 1; i <= n; i++ {
				want := byte(packets.Puback)
				if i%2 == 1 {
					want = packets.Pubrec
				}
				pk, err := c.Read(5 * time.Second)
				require.NoError(t, err, "acknowledgement %d of %d", i, n)
				require.Equal(t, want, pk.FixedHeader.Type, "acknowledgement %d", i)
				require.Equal(t, uint16(i), pk.PacketID, "acknowledgements out of order")
			}
			_, err = c.Read(5 * time.Second)
			require.Error(t, err, "the connection stays open after the DISCONNECT")
			// One write per read of the PUBLISHes (a few, as TCP splits
			// them), not one per acknowledgement.
			require.Less(t, l.writes.Load()-before, int64(8), "writes for %d acknowledgements", n)
		})
	}
}

// A connection the edge closes without a word (an MQTT 3.1.1 client
// refused for a bad topic) first gets the acknowledgements it was owed for
// the PUBLISHes read before: those messages were taken.
func TestBroker_HeldAcksLeaveBeforeTheEdgeCloses(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, nil)
	c := mqtttest.Dial(t, addr, 4)
	c.Connect("closed", true, packets.Properties{})
	var out bytes.Buffer
	for i, topic := range []string{"a/b", "a/+"} {
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1},
			TopicName: topic, PacketID: uint16(i + 1), Payload: []byte("x"), ProtocolVersion: 4}
		require.NoError(t, pk.PublishEncode(&out))
	}
	_, err := c.Conn.Write(out.Bytes())
	require.NoError(t, err)
	pk, err := c.Read(5 * time.Second)
	require.NoError(t, err, "no PUBACK for the publish taken before the refused one")
	require.Equal(t, byte(packets.Puback), pk.FixedHeader.Type)
	require.Equal(t, uint16(1), pk.PacketID)
	_, err = c.Read(5 * time.Second)
	require.Error(t, err, "the connection stays open after the invalid topic")
}

// recordingConn records each Write.
type recordingConn struct {
	net.Conn
	mu     sync.Mutex
	writes [][]uint16 // the packet IDs of each write's acknowledgements
}

func (c *recordingConn) Write(p []byte) (int, error) {
	var ids []uint16
	for w := p; len(w) >= 4; w = w[4:] {
		ids = append(ids, uint16(w[2])<<8|uint16(w[3]))
	}
	c.mu.Lock()
	c.writes = append(c.writes, ids)
	c.mu.Unlock()
	return len(p), nil
}

func (c *recordingConn) written() [][]uint16 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.writes)
}

// recordingClient is an MQTT 3.1.1 client of b whose writes go to rc, and
// its connection's state.
func recordingClient(b *Broker) (*mqtt.Client, *recordingConn, *conn) {
	end, _ := net.Pipe() // for its addresses: writes go to rc
	rc := &recordingConn{Conn: end}
	cl := b.server.NewClient(rc, "test", "pub", false)
	cl.Properties.ProtocolVersion = 4
	return cl, rc, &conn{}
}

func qos1Publish(id uint16) *packets.Packet {
	return &packets.Packet{PacketID: id, FixedHeader: packets.FixedHeader{Qos: 1}}
}

// The queue's one goroutine both waits and writes: what it gathered is
// written before a wait that blocks, and not before one whose message
// every edge took already (its wait returns at once).
func TestAcks_GatheredWrittenBeforeAWaitThatBlocks(t *testing.T) {
	t.Parallel()
	b, _ := startBroker(t, nil)
	t.Run("blocking", func(t *testing.T) {
		cl, rc, c := recordingClient(b)
		gate := make(chan struct{})
		release := sync.OnceFunc(func() { close(gate) })
		t.Cleanup(release) // a failed check does not leave the queue waiting
		b.queueAck(cl, c, qos1Publish(1), nil, false, nil, nil)
		b.queueAck(cl, c, qos1Publish(2), func() error { <-gate; return nil }, false, nil, &Message{})
		testutil.Eventually(t, 5*time.Second, func() error {
			if w := rc.written(); len(w) != 1 || !slices.Equal(w[0], []uint16{1}) {
				return fmt.Errorf("writes %v: the first acknowledgement waits behind the second's wait", w)
			}
			return nil
		})
		release()
		testutil.Eventually(t, 5*time.Second, func() error {
			if w := rc.written(); !slices.EqualFunc(w, [][]uint16{{1}, {2}}, slices.Equal) {
				return fmt.Errorf("writes %v", w)
			}
			return nil
		})
	})

	for _, taken := range []bool{true, false} {
		t.Run(fmt.Sprintf("forwarded_taken=%v", taken), func(t *testing.T) {
			cl, rc, c := recordingClient(b)
			gate := make(chan struct{})
			b.queueAck(cl, c, qos1Publish(1), func() error { <-gate; return nil }, false, nil, &Message{})
			for id := uint16(2); id <= 4; id++ {
				m := &Message{}
				m.Forwarding(1)
				if taken {
					m.ForwardTaken()
				}
				b.queueAck(cl, c, qos1Publish(id), func() error { return nil }, true, nil, m)
			}
			close(gate)
			testutil.Eventually(t, 5*time.Second, func() error {
				if !c.acks.idle() {
					return errors.New("acknowledgements pending")
				}
				return nil
			})
			want := [][]uint16{{1, 2, 3, 4}} // taken: no wait would block
			if !taken {
				want = [][]uint16{{1}, {2}, {3}, {4}} // each wait might have
			}
			require.Equal(t, want, rc.written())
		})
	}
}

// Acknowledgements gathered before the edge was fenced are not written
// after it: the queue fails from the first of them, as from a wait that
// fails (DESIGN: an edge that cannot renew its lease stops acknowledging).
func TestAcks_GatheredNotWrittenOnceFenced(t *testing.T) {
	t.Parallel()
	b, _ := startBroker(t, nil)
	cl, rc, c := recordingClient(b)
	t.Cleanup(b.Unfence)
	taken := func() *Message {
		m := &Message{}
		m.Forwarding(1)
		m.ForwardTaken()
		return m
	}
	// The first waits until the second is queued: then the second's turn
	// comes with the first gathered.
	gate := make(chan struct{})
	b.queueAck(cl, c, qos1Publish(1), func() error { <-gate; return nil }, true, nil, taken())
	b.queueAck(cl, c, qos1Publish(2), func() error { b.Fence(); return nil }, true, nil, taken())
	close(gate)
	testutil.Eventually(t, 5*time.Second, func() error {
		if !c.acks.idle() {
			c.acks.mu.Lock()
			defer c.acks.mu.Unlock()
			if !c.acks.failed {
				return errors.New("acknowledgements pending")
			}
		}
		return nil
	})
	require.Empty(t, rc.written(), "acknowledged once fenced")
}
