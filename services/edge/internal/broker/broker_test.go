package broker

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"

	"github.com/keelmq/keel/services/edge/internal/auth"
)

func seqPayload(i int) []byte { return binary.BigEndian.AppendUint32(nil, uint32(i)) }

func TestBroker_QoS1RoundTrip(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, nil)
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("sub", true, packets.Properties{})
	ack := sub.Subscribe(1, "a/+", 1)
	require.Equal(t, []byte{1}, ack.ReasonCodes)
	pub := mqtttest.Dial(t, addr, 4)
	pub.Connect("pub", true, packets.Properties{})
	pub.Publish(7, "a/b", 1, []byte("hello"))
	require.Equal(t, uint16(7), pub.Expect(packets.Puback).PacketID)
	got := sub.Expect(packets.Publish)
	require.Equal(t, "a/b", got.TopicName)
	require.Equal(t, []byte("hello"), got.Payload)
	require.Equal(t, byte(1), got.FixedHeader.Qos)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
}

// A persistent subscriber that stops reading holds publishers back for the
// grace period and then keeps every message in its session queue: no
// acknowledged QoS 1 message is dropped, and they arrive in order.
func TestBroker_SlowConsumer_PersistentLosesNothing(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, func(c *Config) {
		c.QueueLen = 8
		c.SlowConsumerGrace = 50 * time.Millisecond
	})
	sub := mqtttest.Dial(t, addr, 5)
	sub.Connect("slow", false, packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true, ReceiveMaximum: 10})
	sub.Subscribe(1, "t", 1)

	const n = 300
	pub := mqtttest.Dial(t, addr, 4)
	pub.Connect("pub", true, packets.Properties{})
	for i := range n {
		pub.Publish(uint16(i+1), "t", 1, seqPayload(i))
		require.Equal(t, uint16(i+1), pub.Expect(packets.Puback).PacketID)
	}
	// The publisher was held back at least for the grace, and the wait is
	// observed.
	var waits dto.Metric
	require.NoError(t, b.m.publishWait.Write(&waits))
	require.GreaterOrEqual(t, waits.GetHistogram().GetSampleCount(), uint64(1))
	require.GreaterOrEqual(t, waits.GetHistogram().GetSampleSum(), 0.04)
	// Every message was acknowledged to the publisher. Now read them all.
	for i := range n {
		got := sub.Expect(packets.Publish)
		require.Equal(t, seqPayload(i), got.Payload, "message %d", i)
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
}

// A non-persistent subscriber that stays full past the grace is disconnected
// with 0x97, and the other subscriber of the topic gets every message.
func TestBroker_SlowConsumer_NonPersistentDisconnected(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, func(c *Config) {
		c.QueueLen = 8
		c.SlowConsumerGrace = 100 * time.Millisecond
	})
	slow := mqtttest.Dial(t, addr, 5)
	slow.Connect("slow", true, packets.Properties{ReceiveMaximum: 5})
	slow.Subscribe(1, "t", 1)
	good := mqtttest.Dial(t, addr, 5)
	good.Connect("good", true, packets.Properties{})
	good.Subscribe(1, "t", 1)

	const n = 100
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range n {
			got := good.Expect(packets.Publish)
			if !bytes.Equal(seqPayload(i), got.Payload) {
				t.Errorf("good subscriber: message %d: got %x", i, got.Payload)
				return
			}
			good.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
		}
	}()
	pub := mqtttest.Dial(t, addr, 4)
	pub.Connect("pub", true, packets.Properties{})
	for i := range n {
		pub.Publish(uint16(i+1), "t", 1, seqPayload(i))
		pub.Expect(packets.Puback)
	}
	wg.Wait()
	for {
		pk, err := slow.Read(5 * time.Second)
		require.NoError(t, err, "slow consumer should get DISCONNECT 0x97 before the close")
		if pk.FixedHeader.Type == packets.Disconnect {
			require.Equal(t, packets.ErrQuotaExceeded.Code, pk.ReasonCode)
			break
		}
	}
	require.Eventually(t, func() bool { return b.sessionCount() == 2 }, 5*time.Second, 10*time.Millisecond)
}

func TestBroker_SharedSubscription_OneMemberEach(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, nil)
	var members [2]*mqtttest.Client
	for i := range members {
		members[i] = mqtttest.Dial(t, addr, 5)
		members[i].Connect(fmt.Sprintf("m%d", i), true, packets.Properties{})
		require.Equal(t, []byte{0}, members[i].Subscribe(1, "$share/g/jobs/#", 0).ReasonCodes)
	}
	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	const n = 20
	for i := range n {
		pub.Publish(0, "jobs/x", 0, seqPayload(i))
	}
	seen := map[string]int{}
	counts := [2]int{}
	for i, m := range members {
		for {
			pk, err := m.Read(300 * time.Millisecond)
			if err != nil {
				break
			}
			if pk.FixedHeader.Type == packets.Publish {
				seen[string(pk.Payload)]++
				counts[i]++
			}
		}
	}
	require.Len(t, seen, n)
	for k, v := range seen {
		require.Equal(t, 1, v, "payload %x delivered %d times", k, v)
	}
	require.Positive(t, counts[0])
	require.Positive(t, counts[1])
}

// appendPublish must produce what a standard decoder reads back.
func TestAppendPublish_DecodesWithMochi(t *testing.T) {
	t.Parallel()
	m := &Message{Topic: "acme/x/y", Payload: []byte("payload"), Props: Props{
		PayloadFormat: 1, PayloadFormatFlag: true, ContentType: "text/plain", ResponseTopic: "r/t",
		CorrelationData: []byte{1, 2, 3}, User: []packets.UserProperty{{Key: "k", Val: "v"}, {Key: "k", Val: "w"}},
	}}
	for _, version := range []byte{3, 4, 5} {
		for _, qos := range []byte{0, 1, 2} {
			p := outPublish{topic: "x/y", qos: qos, retain: true, packetID: 513, expiry: 30, subIDs: []int{1, 300}, alias: 4, msg: m}
			if version != 5 {
				p.subIDs, p.alias, p.expiry = nil, 0, 0
			}
			wire := appendPublish(nil, &p, version)
			require.Equal(t, len(wire), publishSize(&p, version))
			var pk packets.Packet
			require.NoError(t, pk.FixedHeader.Decode(wire[0]))
			hdr := 2
			for wire[hdr-1]&0x80 != 0 {
				hdr++
			}
			pk.ProtocolVersion = version
			require.NoError(t, pk.PublishDecode(wire[hdr:]))
			require.Equal(t, "x/y", pk.TopicName)
			require.Equal(t, m.Payload, pk.Payload)
			require.Equal(t, qos, pk.FixedHeader.Qos)
			require.True(t, pk.FixedHeader.Retain)
			if qos > 0 {
				require.Equal(t, uint16(513), pk.PacketID)
			}
			if version == 5 {
				require.Equal(t, "text/plain", pk.Properties.ContentType)
				require.Equal(t, "r/t", pk.Properties.ResponseTopic)
				require.Equal(t, []byte{1, 2, 3}, pk.Properties.CorrelationData)
				require.Equal(t, m.Props.User, pk.Properties.User)
				require.Equal(t, uint32(30), pk.Properties.MessageExpiryInterval)
				require.Equal(t, []int{1, 300}, pk.Properties.SubscriptionIdentifier)
				require.Equal(t, uint16(4), pk.Properties.TopicAlias)
				require.Equal(t, byte(1), pk.Properties.PayloadFormat)
			}
		}
	}
}

func BenchmarkAppendPublish(b *testing.B) {
	m := &Message{Topic: "acme/bench/topic", Payload: make([]byte, 64)}
	p := outPublish{topic: "bench/topic", qos: 1, packetID: 9, msg: m}
	buf := make([]byte, 0, 256)
	b.ReportAllocs()
	for b.Loop() {
		buf = appendPublish(buf[:0], &p, 4)
	}
}

func BenchmarkMochiPublishEncode(b *testing.B) {
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: "bench/topic",
		Payload: make([]byte, 64), PacketID: 9, ProtocolVersion: 4}
	var buf bytes.Buffer
	b.ReportAllocs()
	for b.Loop() {
		buf.Reset()
		_ = pk.PublishEncode(&buf)
	}
}

func TestBroker_SubscribeRefusalCodes(t *testing.T) {
	t.Parallel()
	_, addr := startBroker(t, func(c *Config) {
		c.MaxSubscriptions = 2
		c.SharedDisabled = true
	})
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("c", true, packets.Properties{})
	c.Send(packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Subscribe, Qos: 1},
		PacketID:    1,
		Filters: packets.Subscriptions{
			{Filter: "a/#/b"}, {Filter: "ok/1", Qos: 1}, {Filter: "$share/g/x"}, {Filter: "ok/2", Qos: 2}, {Filter: "ok/3"},
		},
	})
	ack := c.Expect(packets.Suback)
	require.Equal(t, []byte{
		packets.ErrTopicFilterInvalid.Code, // [MQTT-4.7.1-1]
		1,                                  //
		packets.ErrSharedSubscriptionsNotSupported.Code, // 0x9E
		2,                             //
		packets.ErrQuotaExceeded.Code, // third subscription over max 2
	}, ack.ReasonCodes)

	v3 := mqtttest.Dial(t, addr, 4)
	v3.Connect("v3", true, packets.Properties{})
	require.Equal(t, []byte{0x80}, v3.Subscribe(1, "$share/g/x", 0).ReasonCodes)
}

// $SYS topics are per tenant, and '#' does not match them ([MQTT-4.7.2-1]).
func TestBroker_SysTopicsPerTenant(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("watcher", true, packets.Properties{})
	c.Subscribe(1, "#", 0)
	b.publishSys(time.Now())
	c.Subscribe(2, "$SYS/broker/clients/connected", 0) // retained, so delivered on subscribe
	got := c.Expect(packets.Publish)
	require.Equal(t, "$SYS/broker/clients/connected", got.TopicName)
	require.Equal(t, "1", string(got.Payload))
	require.True(t, got.FixedHeader.Retain)
	// Nothing else arrives: '#' saw none of the $SYS topics.
	_, err := c.Read(200 * time.Millisecond)
	require.Error(t, err)
}

type expiringAuth struct{ after time.Duration }

func (a expiringAuth) Authenticate(context.Context, *auth.Request) (*auth.Identity, error) {
	return &auth.Identity{Tenant: "default", ExpiresAt: time.Now().Add(a.after)}, nil
}

// A client whose credentials expire is disconnected with 0x87.
func TestBroker_CredentialsExpireDisconnects(t *testing.T) {
	t.Parallel()
	b, err := New(DefaultConfig(), expiringAuth{after: 300 * time.Millisecond}, nil, nil)
	require.NoError(t, err)
	addr := serveTCP(t, b)
	t.Cleanup(func() { _ = b.Close() })
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("c", true, packets.Properties{})
	pk := c.Expect(packets.Disconnect)
	require.Equal(t, packets.ErrNotAuthorized.Code, pk.ReasonCode)
}

// TestBroker_SharedSubscription_Redispatch: a QoS 1 group message that its
// member refuses (PUBACK 0x80), or that its member's session ends without
// acknowledging, goes to another member; what a member acknowledged stays
// with it. Every message reaches the group exactly once in the end.
func TestBroker_SharedSubscription_Redispatch(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	leaver := mqtttest.Dial(t, addr, 5)
	leaver.Connect("leaver", true, packets.Properties{})
	require.Equal(t, []byte{1}, leaver.Subscribe(1, "$share/g/jobs/#", 1).ReasonCodes)
	stayer := mqtttest.Dial(t, addr, 5)
	stayer.Connect("stayer", true, packets.Properties{})
	require.Equal(t, []byte{1}, stayer.Subscribe(1, "$share/g/jobs/#", 1).ReasonCodes)

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	const n = 20
	for i := range n {
		pub.Publish(uint16(i+1), "jobs/x", 1, seqPayload(i))
		pub.Expect(packets.Puback)
	}
	// The leaver acknowledges its first message, refuses its second and
	// leaves the rest unacknowledged when its connection drops.
	var kept string
	held := 0
	for {
		pk, err := leaver.Read(500 * time.Millisecond)
		if err != nil {
			break
		}
		if pk.FixedHeader.Type != packets.Publish {
			continue
		}
		switch held++; held {
		case 1:
			kept = string(pk.Payload)
			leaver.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		case 2:
			leaver.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID,
				ReasonCode: packets.ErrUnspecifiedError.Code})
		}
	}
	require.GreaterOrEqual(t, held, 3, "the leaver got a share of the messages")
	_ = leaver.Conn.Close()

	seen := map[string]int{kept: 1}
	for len(seen) < n {
		pk, err := stayer.Read(5 * time.Second)
		require.NoError(t, err, "the stayer got %d of %d", len(seen), n)
		if pk.FixedHeader.Type != packets.Publish {
			continue
		}
		seen[string(pk.Payload)]++
		stayer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	}
	if pk, err := stayer.Read(500 * time.Millisecond); err == nil {
		seen[string(pk.Payload)]++
	}
	for i := range n {
		require.Equal(t, 1, seen[string(seqPayload(i))], "message %d reached the group once", i)
	}
	require.Equal(t, float64(held-1), testutil.ToFloat64(b.m.sharedRedispatch.WithLabelValues("local")))
}

// A connection the edge itself closes (here as when credentials expire,
// with 0x87) ended without a normal DISCONNECT: its will goes out, every
// time, however the close meets the connection's read loop.
func TestBroker_WillOnServerInitiatedDisconnect(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	watcher := mqtttest.Dial(t, addr, 5)
	watcher.Connect("watcher", true, packets.Properties{})
	require.Equal(t, []byte{1}, watcher.Subscribe(1, "gone/#", 1).ReasonCodes)
	for i := range 30 {
		id := fmt.Sprintf("dev-%d", i)
		c := mqtttest.Dial(t, addr, 5)
		c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
			Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: id,
				WillFlag: true, WillTopic: "gone/" + id, WillQos: 1, WillPayload: []byte(id)}})
		require.Equal(t, packets.CodeSuccess.Code, c.Expect(packets.Connack).ReasonCode)
		sc, err := b.scope("default")
		require.NoError(t, err)
		var cl *mqtt.Client
		require.Eventually(t, func() bool {
			found, ok := b.server.Clients.Get(sc.ClientID(id))
			cl = found
			return ok && b.conn(found) != nil
		}, 5*time.Second, time.Millisecond)
		// The client is busy, so that the close may meet its read loop
		// between two packets (mochi then reports no error, as for a
		// normal DISCONNECT) as well as inside a read.
		busy := make(chan struct{})
		go func() {
			defer close(busy)
			// QoS 0 publishes: handled without a reply, so the read loop
			// can find the connection closed right after one.
			pub := []byte{packets.Publish << 4, 7, 0, 4, 'n', 'o', 'n', 'e', 0}
			for range 2000 {
				if _, err := c.Conn.Write(pub); err != nil {
					return
				}
			}
		}()
		time.Sleep(time.Millisecond)
		_ = b.server.DisconnectClient(cl, packets.ErrNotAuthorized) // returns the code it sent
		<-busy
		will := watcher.Expect(packets.Publish)
		require.Equal(t, id, string(will.Payload), "round %d", i)
		watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: will.PacketID})
	}
}

// A QoS 1 group message published here and picked for a member whose
// connection is closing (a slow consumer being disconnected: it takes
// nothing more) goes to another member of the group: acknowledged to its
// publisher, it was not dropped with no member having it.
func TestBroker_SharedMessageForAClosingMemberGoesToAnother(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	closing := mqtttest.Dial(t, addr, 5)
	closing.Connect("closing", true, packets.Properties{})
	require.Equal(t, []byte{1}, closing.Subscribe(1, "$share/g/jobs/#", 1).ReasonCodes)
	other := mqtttest.Dial(t, addr, 5)
	other.Connect("other", true, packets.Properties{})
	require.Equal(t, []byte{1}, other.Subscribe(1, "$share/g/jobs/#", 1).ReasonCodes)
	// Its disconnect as a slow consumer is under way (disconnectSlow).
	s := b.session(b.mustScope(t, "default").ClientID("closing"))
	s.mu.Lock()
	s.slow = true
	s.mu.Unlock()

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", true, packets.Properties{})
	const n = 4 // in turn, the group picks each member for some
	for i := range n {
		pub.Publish(uint16(i+1), "jobs/x", 1, seqPayload(i))
		pub.Expect(packets.Puback)
	}
	for i := range n {
		pk, err := other.Read(2 * time.Second)
		require.NoError(t, err, "acknowledged, message %d reached no member", i)
		require.Equal(t, packets.Publish, pk.FixedHeader.Type)
		require.Equal(t, seqPayload(i), pk.Payload)
		other.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	}
}
