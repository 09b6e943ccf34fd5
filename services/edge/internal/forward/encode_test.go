package forward

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

func scopeOf(t testing.TB, tenant string) *tenancy.Scope {
	t.Helper()
	sc, err := tenancy.NewScope(tenant)
	require.NoError(t, err)
	return sc
}

// runtimeForward is what the encoder must write: the runtime's encoding of
// the ForwardMessage a plain message was sent as before.
func runtimeForward(t testing.TB, m *broker.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(&edgev1.ForwardMessage{Message: m.Proto(), SharedChosen: true})
	require.NoError(t, err)
	return b
}

// The hand encoder writes exactly the runtime's bytes, for every field a
// message may carry and their zero values (which proto3 leaves out).
func TestAppendForwardMessage(t *testing.T) {
	acme := scopeOf(t, "acme")
	full := &broker.Message{ID: broker.MsgID{Edge: "edge-a", Incarnation: 7, Seq: 1 << 40},
		Topic: acme.Topic("sensors/room-1/temperature"), Payload: []byte("21.5"), QoS: 2, Retain: true,
		Origin: acme.ClientID("sensor-1"), Created: 1_700_000_000_123_456_789,
		Props: broker.Props{ContentType: "text/plain", ResponseTopic: "replies/1", CorrelationData: []byte{0, 1, 2},
			PayloadFormat: 1, PayloadFormatFlag: true, MessageExpiryInterval: 3600,
			User: []packets.UserProperty{{Key: "k", Val: "v"}, {Key: "k", Val: ""}, {Key: "", Val: "x"}, {Key: "ü", Val: "ß"}}}}
	for name, m := range map[string]*broker.Message{
		"full":            full,
		"bare":            {Topic: acme.Topic("t")},
		"no_origin":       {ID: broker.MsgID{Edge: "e"}, Topic: acme.Topic("a/b"), Payload: []byte("x"), QoS: 1, Created: 5},
		"dollar_topic":    {ID: broker.MsgID{Edge: "e", Seq: 1}, Topic: acme.Topic("$SYS/x"), Payload: []byte("y")},
		"format_zero_set": {Topic: acme.Topic("t"), Props: broker.Props{PayloadFormatFlag: true}},
		"negative_time":   {Topic: acme.Topic("t"), Created: -1},
		"large_payload":   {Topic: acme.Topic("t"), Payload: bytes.Repeat([]byte("p"), 70_000)},
	} {
		got, ok := appendForwardMessage(nil, m)
		require.True(t, ok, name)
		require.Equal(t, runtimeForward(t, m), got, name)
		// Appended after what is there already.
		prefix := []byte("prefix")
		again, _ := appendForwardMessage(prefix, m)
		require.Equal(t, append([]byte("prefix"), got...), again, name)
	}

	// Left to the runtime: strings that are not UTF-8 (which it refuses),
	// a topic outside any tenant.
	bad := &broker.Message{Topic: acme.Topic("t"), Props: broker.Props{ResponseTopic: "\xff"}}
	_, ok := appendForwardMessage(nil, bad)
	require.False(t, ok)
	bad = &broker.Message{Topic: acme.Topic("sensors/\xc3x")}
	_, ok = appendForwardMessage(nil, bad)
	require.False(t, ok)
	_, ok = appendForwardMessage(nil, &broker.Message{Topic: "no tenant"})
	require.False(t, ok)
}

// The encoder writes each tag as one byte: every field it writes has a
// number below 16.
func TestAppendTag_OneByte(t *testing.T) {
	for _, num := range []protowire.Number{fMsgID, fTenant, fTopic, fPayload, fQoS, fRetain, fIngress, fClientID,
		fContentType, fResponseTopic, fCorrelation, fUserProps, fFormat, fExpiry,
		fIDEdge, fIDIncarnation, fIDSeq, fPropKey, fPropValue, fFwdMessage, fFwdSharedChosen} {
		for _, typ := range []protowire.Type{protowire.VarintType, protowire.BytesType} {
			require.Equal(t, protowire.AppendTag(nil, num, typ), appendTag(nil, num, typ), "field %d", num)
		}
	}
	for _, v := range []uint64{0, 1, 0x7f, 0x80, 300, 1 << 40, 1<<64 - 1} {
		require.Equal(t, protowire.AppendVarint(nil, v), appendUvarint(nil, v), "varint %d", v)
	}
}

// A frame whose messages travel pre-encoded (Link.request) decodes, with the
// runtime and with the receiving edge's own decoder, to the request the
// runtime would have sent, in frame order, pre-encoded, marshalled and
// plain QoS 0 messages (in runs) mixed.
func TestLinkRequest_PreEncodedMessagesInOrder(t *testing.T) {
	acme := scopeOf(t, "acme")
	l := NewLink("edge-a", 3, "edge-b", "http://127.0.0.1:1", testutil.Logger(t), nil)
	want := &edgev1.ForwardRequest{EdgeId: "edge-a", Incarnation: 3}
	for i := range 9 {
		m := &broker.Message{ID: broker.MsgID{Edge: "edge-a", Incarnation: 3, Seq: uint64(i)},
			Topic: acme.Topic("t"), Payload: []byte{byte(i)}, QoS: 1}
		if i%3 == 0 || i == 4 {
			m.QoS = 0
		}
		fm := &edgev1.ForwardMessage{Message: m.Proto(), SharedChosen: true}
		raw, ok := appendForwardMessage(nil, m)
		require.True(t, ok)
		switch {
		case i == 1 || i == 5:
			fm.Shared = []*edgev1.SharedTarget{{Group: "g", Filter: "t"}}
			l.send(&pending{msg: proto.CloneOf(fm)})
		case m.QoS == 0:
			l.sendPlain(raw, 1) // 3 and 4 share a run
			clear(raw)          // the caller's to reuse
		default:
			l.send(&pending{raw: raw, size: 1})
		}
		want.Messages = append(want.Messages, fm)
	}
	f := l.nextFrame() // encodes the messages with shared targets
	require.Equal(t, 9, f.count)
	want.Seq = f.seq
	wire, err := proto.Marshal(l.request(f))
	require.NoError(t, err)
	var byRuntime, byHand edgev1.ForwardRequest
	require.NoError(t, proto.Unmarshal(wire, &byRuntime))
	require.True(t, proto.Equal(want, &byRuntime), "runtime: %v", &byRuntime)
	require.NoError(t, decodeForwardRequest(wire, &byHand))
	require.True(t, proto.Equal(want, &byHand), "hand: %v", &byHand)
}

// Plain QoS 0 messages share runs of at most runMessages, and a frame takes
// runs up to maxFrameMessages messages (a run may take it past them): the
// frames carry every message once, in the order sent.
func TestLink_PlainRunsFillFramesInOrder(t *testing.T) {
	acme := scopeOf(t, "acme")
	l := NewLink("edge-a", 3, "edge-b", "http://127.0.0.1:1", testutil.Logger(t), nil)
	const n = 3*maxFrameMessages + 17
	for i := range n {
		m := &broker.Message{ID: broker.MsgID{Edge: "edge-a", Incarnation: 3, Seq: uint64(i)}, Topic: acme.Topic("t"), Payload: []byte{byte(i)}}
		raw, ok := appendForwardMessage(nil, m)
		require.True(t, ok)
		if i == 100 {
			m.QoS = 1 // a message of its own between two runs
			raw, _ = appendForwardMessage(nil, m)
			l.send(&pending{raw: raw, size: 1})
			continue
		}
		l.sendPlain(raw, 1)
	}
	var seqs []uint64
	for {
		f := l.nextFrame()
		if f == nil {
			break
		}
		require.LessOrEqual(t, f.count, maxFrameMessages+runMessages-1)
		if len(seqs)+f.count < n {
			require.GreaterOrEqual(t, f.count, maxFrameMessages, "a frame that is not the last is full")
		}
		wire, err := proto.Marshal(l.request(f))
		require.NoError(t, err)
		var req edgev1.ForwardRequest
		require.NoError(t, decodeForwardRequest(wire, &req))
		require.Len(t, req.GetMessages(), f.count)
		for _, fm := range req.GetMessages() {
			seqs = append(seqs, fm.GetMessage().GetId().GetSeq())
		}
		l.acked(f.seq) // the window has room for the next
	}
	require.Len(t, seqs, n)
	for i, s := range seqs {
		require.Equal(t, uint64(i), s)
	}
	require.Zero(t, l.queued)
}

// A run starts with room for its first message alone while the link sends
// each message at once (its buffer lives until the peer acknowledges it),
// and with room for many once frames wait for the window.
func TestLink_RunSizedByTheWindow(t *testing.T) {
	acme := scopeOf(t, "acme")
	l := NewLink("edge-a", 3, "edge-b", "http://127.0.0.1:1", testutil.Logger(t), nil)
	raw, ok := appendForwardMessage(nil, &broker.Message{Topic: acme.Topic("t"), Payload: make([]byte, 64)})
	require.True(t, ok)
	for range sendWindow {
		l.sendPlain(raw, 64)
		require.Less(t, cap(l.run.raw), 2*len(raw), "an idle link's run")
		require.NotNil(t, l.nextFrame()) // sent, not acknowledged
	}
	l.sendPlain(raw, 64)
	require.GreaterOrEqual(t, cap(l.run.raw), 64*len(raw), "a run that gathers while the window is full")
}

// FuzzAppendForwardMessage holds the encoder to the runtime: whatever it
// encodes, the runtime decodes to the message it was given; what it
// leaves alone, the runtime would not marshal or has no tenant.
func FuzzAppendForwardMessage(f *testing.F) {
	f.Add("edge-a", uint64(7), uint64(1), "acme", "a/b", []byte("x"), byte(1), true, int64(5), "c1", "ct", "rt", []byte{1}, "k", "v", byte(1), uint32(60))
	f.Add("", uint64(0), uint64(0), "t", "$SYS/x", []byte(nil), byte(0), false, int64(-1), "", "", "", []byte(nil), "", "", byte(0), uint32(0))
	f.Add("edge-ü", uint64(1<<40), uint64(300), "acme", "a/b\xff", bytes.Repeat([]byte("p"), 200), byte(1), false, int64(1)<<62, "c1", "", "", []byte(nil), "", "", byte(0), uint32(1<<20))
	f.Add("e\xff", uint64(1), uint64(2), "t", "x", []byte{}, byte(2), false, int64(0), "\xc3", "", "", []byte(nil), "\xff", "", byte(0), uint32(1))
	f.Fuzz(func(t *testing.T, edge string, inc, seq uint64, tenant, topic string, payload []byte, qos byte, retain bool,
		created int64, client, ct, rt string, corr []byte, key, val string, format byte, expiry uint32) {
		sc, err := tenancy.NewScope(tenant)
		if err != nil {
			return
		}
		m := &broker.Message{ID: broker.MsgID{Edge: edge, Incarnation: inc, Seq: seq}, Topic: sc.Topic(topic),
			Payload: payload, QoS: qos % 3, Retain: retain, Created: created,
			Props: broker.Props{ContentType: ct, ResponseTopic: rt, CorrelationData: corr, MessageExpiryInterval: expiry}}
		if client != "" {
			m.Origin = sc.ClientID(client)
		}
		if key != "" || val != "" {
			m.Props.User = []packets.UserProperty{{Key: key, Val: val}}
		}
		if format > 0 {
			m.Props.PayloadFormat, m.Props.PayloadFormatFlag = format%2, true
		}
		got, ok := appendForwardMessage(nil, m)
		want := &edgev1.ForwardMessage{Message: m.Proto(), SharedChosen: true}
		if !ok {
			_, _, inTenant := tenancy.TenantOfTopic(m.Topic)
			if _, err := proto.Marshal(want); err == nil && inTenant {
				t.Fatalf("left to the runtime, which marshals it: %v", want)
			}
			return
		}
		var back edgev1.ForwardMessage
		if err := proto.Unmarshal(got, &back); err != nil {
			t.Fatalf("runtime cannot decode it: %v", err)
		}
		if !proto.Equal(want, &back) {
			t.Fatalf("decoded %v, want %v", &back, want)
		}
	})
}

// BenchmarkForward_Encode compares building and marshalling the structs per
// message (before) with the hand encoder, for a 64-byte QoS 0 message.
func BenchmarkForward_Encode(b *testing.B) {
	acme := scopeOf(b, "acme")
	m := &broker.Message{ID: broker.MsgID{Edge: "edge-a", Incarnation: 7, Seq: 123456},
		Topic: acme.Topic("bench/pair/17"), Payload: make([]byte, 64), Origin: acme.ClientID("kb-p17"), Created: 1_700_000_000_000_000_000}
	b.Run("codec=runtime", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			fm := &edgev1.ForwardMessage{Message: m.Proto(), SharedChosen: true}
			if _, err := proto.Marshal(fm); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("codec=hand", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := appendForwardMessage(nil, m); !ok {
				b.Fatal("not encoded")
			}
		}
	})
}

// A message the runtime cannot encode (a string not UTF-8) fails alone and
// unacknowledged as its frame is made, and the frame carries the others:
// left in the frame, the frame's acknowledgement would count it as taken.
func TestLink_UnencodableMessageFailsAlone(t *testing.T) {
	acme := scopeOf(t, "acme")
	l := NewLink("edge-a", 3, "edge-b", "http://127.0.0.1:1", testutil.Logger(t), nil)
	good := &broker.Message{Topic: acme.Topic("t"), Payload: []byte("ok"), QoS: 1}
	raw, ok := appendForwardMessage(nil, good)
	require.True(t, ok)
	okSent := &pending{raw: raw, size: 2, waits: true}
	l.send(okSent)
	badSent := &pending{msg: &edgev1.ForwardMessage{Message: &commonv1.Message{Tenant: "acme", Topic: "\xff"}, SharedChosen: true}, waits: true}
	l.send(badSent)
	f := l.nextFrame()
	require.Len(t, f.msgs, 1)
	require.Equal(t, raw, f.msgs[0].raw)
	err, over, _ := badSent.outcome()
	require.True(t, over, "the unencodable message is not failed")
	require.ErrorContains(t, err, "not encodable")
	_, over, _ = okSent.outcome()
	require.False(t, over, "the encodable message is over before its frame was acknowledged")
	l.acked(f.seq)
	err, over, _ = okSent.outcome()
	require.True(t, over)
	require.NoError(t, err)
}

// BenchmarkLink_QoS0 is what a link under load costs a forwarded QoS 0
// message on the sending edge, from its encoding to its frame's request
// marshalled and acknowledged, with the window full as under load (two
// frames unacknowledged): as a struct of its own with its own encoding
// (pending), or encoded into a buffer reused and copied into the run at
// the queue's tail (run, sendPlain).
func BenchmarkLink_QoS0(b *testing.B) {
	acme := scopeOf(b, "acme")
	m := &broker.Message{ID: broker.MsgID{Edge: "edge-a", Incarnation: 7, Seq: 123456},
		Topic: acme.Topic("bench/pair/17"), Payload: make([]byte, 64), Origin: acme.ClientID("kb-p17"), Created: 1_700_000_000_000_000_000}
	for _, c := range []struct {
		name string
		send func(l *Link, scratch []byte) []byte
	}{
		{"pending", func(l *Link, _ []byte) []byte {
			raw, _ := appendForwardMessage(nil, m)
			l.send(&pending{raw: raw, size: len(m.Payload)})
			return nil
		}},
		{"run", func(l *Link, scratch []byte) []byte {
			raw, _ := appendForwardMessage(scratch[:0], m)
			l.sendPlain(raw, len(m.Payload))
			return raw
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			l := NewLink("edge-a", 7, "edge-b", "http://127.0.0.1:1", testutil.Logger(b), nil)
			var scratch []byte
			var sent []*frame
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				scratch = c.send(l, scratch)
				if i++; i%maxFrameMessages == 0 {
					f := l.nextFrame()
					if _, err := proto.Marshal(l.request(f)); err != nil {
						b.Fatal(err)
					}
					if sent = append(sent, f); len(sent) > sendWindow {
						l.acked(sent[0].seq)
						sent = sent[1:]
					}
				}
			}
		})
	}
}

// BenchmarkForwarder_QoS1 is what the sending edge's forwarder costs a QoS
// 1 message to one peer: Forward, the message's frame made, marshalled and
// acknowledged with the window full as under load, and the publish's wait
// for it, which under load finds the message taken.
func BenchmarkForwarder_QoS1(b *testing.B) {
	acme := scopeOf(b, "acme")
	m := &broker.Message{ID: broker.MsgID{Edge: "edge-a", Incarnation: 7, Seq: 123456}, QoS: 1,
		Topic: acme.Topic("bench/pair/17"), Payload: make([]byte, 64), Origin: acme.ClientID("kb-p17"), Created: 1_700_000_000_000_000_000}
	peer := Peer{ID: "edge-b", URL: "http://127.0.0.1:1", Incarnation: 1}
	f := &Forwarder{Self: "edge-a", Incarnation: func() uint64 { return 7 }, Resolver: staticRoutes{peer},
		Bound: time.Minute, Logger: testutil.Logger(b)}
	// A running forwarder whose link to the peer runs no stream: the
	// benchmark makes and acknowledges its frames.
	f.ctx = context.Background()
	l := NewLink(f.Self, 7, peer.ID, peer.URL, f.log(), nil)
	l.target = peer.Incarnation
	f.links = map[string]*Link{peer.ID: l}
	type sentFrame struct {
		f     *frame
		waits []func() error
	}
	var inFrame []func() error
	var sent []sentFrame
	b.ReportAllocs()
	for b.Loop() {
		wait, _, err := f.Forward(context.Background(), m, nil)
		if err != nil || wait == nil {
			b.Fatal("not forwarded", err)
		}
		if inFrame = append(inFrame, wait); len(inFrame) < maxFrameMessages {
			continue
		}
		fr := l.nextFrame()
		if _, err := proto.Marshal(l.request(fr)); err != nil {
			b.Fatal(err)
		}
		sent, inFrame = append(sent, sentFrame{fr, inFrame}), nil
		if len(sent) > sendWindow {
			l.acked(sent[0].f.seq)
			for _, w := range sent[0].waits {
				if err := w(); err != nil {
					b.Fatal(err)
				}
			}
			sent = sent[1:]
		}
	}
}

// Forward tells a QoS 1 message the outcome of each copy before its wait
// can see it (broker.Message.ForwardsTaken), and again when it is routed
// again: the acknowledgement queue writes what it gathered before a wait
// that would block.
func TestForward_TellsTheMessageItsCopiesOutcomes(t *testing.T) {
	acme := scopeOf(t, "acme")
	peers := []Peer{{ID: "edge-b", URL: "http://127.0.0.1:1", Incarnation: 1}, {ID: "edge-c", URL: "http://127.0.0.1:2", Incarnation: 1}}
	f := &Forwarder{Self: "edge-a", Incarnation: func() uint64 { return 7 }, Resolver: staticRoutes(peers),
		Bound: time.Minute, Logger: testutil.Logger(t)}
	f.ctx = context.Background() // running, with links that run no stream
	links := map[string]*Link{}
	for _, p := range peers {
		links[p.ID] = NewLink(f.Self, 7, p.ID, p.URL, f.log(), nil)
		links[p.ID].target = p.Incarnation
	}
	f.links = links
	m := &broker.Message{ID: broker.MsgID{Edge: "edge-a", Incarnation: 7, Seq: 1}, QoS: 1,
		Topic: acme.Topic("t"), Payload: []byte("x"), Origin: acme.ClientID("pub")}

	wait, _, err := f.Forward(context.Background(), m, nil)
	require.NoError(t, err)
	b, c := links["edge-b"].nextFrame(), links["edge-c"].nextFrame()
	require.False(t, m.ForwardsTaken(), "no copy taken yet")
	links["edge-b"].acked(b.seq)
	require.False(t, m.ForwardsTaken(), "one copy of two taken")
	links["edge-c"].acked(c.seq)
	require.True(t, m.ForwardsTaken())
	require.NoError(t, wait())

	// Routed again: a copy that fails is told too.
	wait, _, err = f.Forward(context.Background(), m, nil)
	require.NoError(t, err)
	require.False(t, m.ForwardsTaken(), "a new forwarding")
	b, c = links["edge-b"].nextFrame(), links["edge-c"].nextFrame()
	links["edge-b"].acked(b.seq)
	links["edge-c"].fail(ErrPeerGone)
	require.False(t, m.ForwardsTaken(), "a copy failed")
	require.ErrorIs(t, wait(), ErrPeerGone)
}
