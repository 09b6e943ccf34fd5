package broker

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// failingEnqueueOf is a real durable store whose first Enqueue for session
// id fails.
type failingEnqueueOf struct {
	*durable.Store
	id     string
	failed atomic.Bool
	msgID  atomic.Value // string: the message whose queueing failed
}

func (s *failingEnqueueOf) Enqueue(id string, e durable.Entry) *durable.Pending {
	if id == s.id && s.failed.CompareAndSwap(false, true) {
		s.msgID.Store(e.MsgID)
		return durable.DonePending(errors.New("injected store failure"))
	}
	return s.Store.Enqueue(id, e)
}

// Send fails too for the message whose queueing failed: the store is down
// for that session, and a send the writer made of it before the failure
// was known does not store it either (a stored one would mean the session
// has the message).
func (s *failingEnqueueOf) Send(id string, entries []durable.Entry) *durable.Pending {
	if failed, _ := s.msgID.Load().(string); id == s.id && failed != "" {
		for _, e := range entries {
			if e.MsgID == failed {
				return durable.DonePending(errors.New("injected store failure"))
			}
		}
	}
	return s.Store.Send(id, entries)
}

// A forwarded message for a shared group with two members here, taken by
// one of them, that fails for another reason (a persistent recipient's
// store write fails, at once or once its deferred writes are waited for;
// or the relay to a handed-over session's owner fails) is sent again: the
// resend goes to the member that took it, never to the other one (a QoS 2
// message to two members breaks invariant 2; a QoS 1 one is re-dispatched
// only when its member refuses it or goes).
func TestBroker_ResendGoesToTheSameGroupMember(t *testing.T) {
	for _, tc := range []struct {
		name  string
		qos   uint32
		fail  string // "store", "deferred" or "relay"
		after func(t *testing.T, c *mqtttest.Client)
	}{
		{name: "qos2_store", qos: 2, fail: "store"},
		{name: "qos2_deferred", qos: 2, fail: "deferred"},
		{name: "qos2_relay", qos: 2, fail: "relay"},
		{name: "qos1_relay", qos: 1, fail: "relay"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := &failingEnqueueOf{}
			b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { st.Store = s; return st })
			addr := serveTCP(t, b)
			peers := &relayingPeers{}
			b.SetCluster(Cluster{Peers: peers})
			sc := b.mustScope(t, "default")
			if tc.fail == "relay" {
				st.failed.Store(true)
				peers.err = errors.New("new owner unreachable")
				b.handed.add(&session{id: sc.ClientID("gone"), scope: sc, subs: map[string]*subscription{
					"g/#": {filter: sc.Topic("g/#"), full: sc.Topic("g/#"), qos: 2}}}, time.Now(), "edge-new", 21)
			} else {
				st.id = sc.ClientID("slow")
				persistentSubscriber(t, addr, "slow", "g/#")
			}
			members := connectMembers(t, addr, "$share/G/g/#", "m1", "m2")

			m := forwardedMsg(1, "g/x", tc.qos, time.Now().Add(-time.Second))
			choice := SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "G", Filter: "g/#"}}}
			deliver := func() error {
				if tc.fail != "deferred" {
					return b.DeliverForwarded(context.Background(), m, choice)
				}
				d := new(Deferred)
				d.Message(0)
				if err := b.DeliverForwarded(DeferWrites(context.Background(), d), m, choice); err != nil {
					return err
				}
				return d.Wait(1)[0]
			}
			require.Error(t, deliver(), "the first attempt fails")
			peers.mu.Lock()
			peers.err = nil
			peers.mu.Unlock()
			require.NoError(t, deliver(), "sent again, it is taken")

			got := map[int]int{}
			for i, c := range members {
				for {
					pk, err := c.Read(300 * time.Millisecond)
					if err != nil {
						break
					}
					require.Equal(t, packets.Publish, pk.FixedHeader.Type)
					got[i]++
					if pk.FixedHeader.Qos == 1 {
						c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
					}
				}
			}
			require.Len(t, got, 1, "one member of the group gets it: %v", got)
		})
	}
}

// A resend of a forwarded group message whose member here took it and
// has gone since (its session ended): a QoS 2 message is that member's
// alone and goes to no other member ([MQTT-4.8.2-5]); a QoS 1 one goes to
// another, as the member's end re-dispatches it.
func TestBroker_ResendAfterTheGroupMemberLeft(t *testing.T) {
	for _, qos := range []uint32{1, 2} {
		t.Run(fmt.Sprintf("qos%d", qos), func(t *testing.T) {
			t.Parallel()
			b, addr := startBroker(t, nil)
			peers := &relayingPeers{err: errors.New("new owner unreachable")}
			b.SetCluster(Cluster{Peers: peers})
			sc := b.mustScope(t, "default")
			b.handed.add(&session{id: sc.ClientID("gone"), scope: sc, subs: map[string]*subscription{
				"g/#": {filter: sc.Topic("g/#"), full: sc.Topic("g/#"), qos: 2}}}, time.Now(), "edge-new", 21)
			members := connectMembers(t, addr, "$share/G/g/#", "m1", "m2")
			m := forwardedMsg(1, "g/x", qos, time.Now().Add(-time.Second))
			choice := SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "G", Filter: "g/#"}}}
			require.Error(t, b.DeliverForwarded(t.Context(), m, choice))
			took := -1
			for i, c := range members {
				if pk, err := c.Read(300 * time.Millisecond); err == nil {
					require.Equal(t, packets.Publish, pk.FixedHeader.Type)
					took = i
				}
			}
			require.NotEqual(t, -1, took)
			members[took].Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
			other := members[1-took]
			require.Eventually(t, func() bool { return b.session(sc.ClientID([]string{"m1", "m2"}[took])) == nil },
				5*time.Second, time.Millisecond)

			peers.mu.Lock()
			peers.err = nil
			peers.mu.Unlock()
			require.NoError(t, b.DeliverForwarded(t.Context(), m, choice))
			if qos == 2 {
				expectNothing(t, other, 300*time.Millisecond)
				require.Equal(t, 1.0, promtestutil.ToFloat64(b.m.sharedRedispatch.WithLabelValues("qos2_dropped")))
			} else {
				require.Equal(t, "g/x", other.Expect(packets.Publish).TopicName)
			}
		})
	}
}

// A QoS 2 PUBLISH of a client here that a member of a shared group here
// took, not acknowledged because a persistent recipient's store write
// failed, is sent again by its client (DUP, same packet ID, so the same
// msgID): the resend goes to the member that took it, not to the other.
func TestBroker_PublisherResendGoesToTheSameGroupMember(t *testing.T) {
	t.Parallel()
	st := &failingEnqueueOf{}
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { st.Store = s; return st })
	addr := serveTCP(t, b)
	st.id = b.mustScope(t, "default").ClientID("slow")
	persistentSubscriber(t, addr, "slow", "g/#")
	members := connectMembers(t, addr, "$share/G/g/#", "m1", "m2")

	pub := mqtttest.Dial(t, addr, 5)
	pub.Connect("pub", false, persistentProps)
	pub.Publish(7, "g/x", 2, []byte("once"))
	for {
		pk, err := pub.Read(5 * time.Second)
		if err != nil {
			break // closed without a PUBREC
		}
		require.NotEqual(t, packets.Pubrec, pk.FixedHeader.Type, "not every recipient took it: no PUBREC")
	}
	pub = mqtttest.Dial(t, addr, 5)
	require.True(t, pub.Connect("pub", false, persistentProps).SessionPresent)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 2, Dup: true}, PacketID: 7,
		TopicName: "g/x", Payload: []byte("once")})
	require.Equal(t, uint16(7), pub.Expect(packets.Pubrec).PacketID)

	got := received(members)
	require.Len(t, got, 1, "one member of the group gets it: %v", got)
}

// groupMembers is how many members group name has here on filter (its
// internal form).
func groupMembers(b *Broker, name, filter string) int {
	b.index.mu.RLock()
	defer b.index.mu.RUnlock()
	if g := b.index.byKey[name+"\x00"+filter]; g != nil {
		return len(g.members)
	}
	return 0
}

// A forwarded QoS 2 group message that fails here (a relay fails) after a
// persistent member took it, whose deferred store write then fails too,
// never reached that member: the member is not remembered as the one that
// took it. Sent again once that member is gone, the message goes to the
// group's other member, rather than counting as committed to a member
// that never had it and reaching nobody.
func TestBroker_ResendSkipsAMemberWhoseDeferredWriteFailed(t *testing.T) {
	t.Parallel()
	st := &failingEnqueueOf{}
	b, _ := brokerOnStore(t, func(s *durable.Store) DurableState { st.Store = s; return st })
	addr := serveTCP(t, b)
	peers := &relayingPeers{err: errors.New("new owner unreachable")}
	b.SetCluster(Cluster{Peers: peers})
	sc := b.mustScope(t, "default")
	b.handed.add(&session{id: sc.ClientID("gone"), scope: sc, subs: map[string]*subscription{
		"g/#": {filter: sc.Topic("g/#"), full: sc.Topic("g/#"), qos: 2}}}, time.Now(), "edge-new", 21)
	other := mqtttest.Dial(t, addr, 5)
	other.Connect("other", true, packets.Properties{})
	other.Subscribe(1, "$share/G/g/#", 2)
	// Second in the group: the first message goes to it.
	st.id = sc.ClientID("durable")
	durableMember := mqtttest.Dial(t, addr, 5)
	durableMember.Connect("durable", false, persistentProps)
	durableMember.Subscribe(1, "$share/G/g/#", 2)

	m := forwardedMsg(1, "g/x", 2, time.Now().Add(-time.Second))
	choice := SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "G", Filter: "g/#"}}}
	deliver := func() error {
		d := new(Deferred)
		d.Message(0)
		if err := b.DeliverForwarded(DeferWrites(context.Background(), d), m, choice); err != nil {
			_ = d.Wait(1)
			return err
		}
		return d.Wait(1)[0]
	}
	require.Error(t, deliver(), "the relay fails")
	require.True(t, st.failed.Load(), "the durable member was picked, and its write failed")
	expectNothing(t, other, 200*time.Millisecond)

	// The durable member's session ends: its client starts a new one.
	durableMember = mqtttest.Dial(t, addr, 5)
	require.False(t, durableMember.Connect("durable", true, packets.Properties{}).SessionPresent)
	require.Eventually(t, func() bool { return groupMembers(b, "G", sc.Topic("g/#")) == 1 }, 5*time.Second, time.Millisecond)

	peers.mu.Lock()
	peers.err = nil
	peers.mu.Unlock()
	require.NoError(t, deliver(), "sent again, it is taken")
	require.Equal(t, "g/x", other.Expect(packets.Publish).TopicName, "the group's other member gets it")
	require.Zero(t, promtestutil.ToFloat64(b.m.sharedRedispatch.WithLabelValues("qos2_dropped")))
}

// A forwarded QoS 2 message for a shared group here that was taken, and
// comes again (its publisher, on another edge, was not acknowledged for a
// third edge's sake, and sent it again under the same msgID), goes to the
// member that took it, not to the next member in turn: a QoS 2 message to
// two members breaks invariant 2.
func TestBroker_QoS2GroupMessageSentAgainGoesToTheSameMember(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	members := connectMembers(t, addr, "$share/G/g/#", "m1", "m2")
	m := forwardedMsg(1, "g/x", 2, time.Now())
	choice := SharedChoice{Chosen: true, Groups: []GroupKey{{Name: "G", Filter: "g/#"}}}
	require.NoError(t, b.DeliverForwarded(t.Context(), m, choice))
	require.NoError(t, b.DeliverForwarded(t.Context(), m, choice), "sent again")
	got := received(members)
	require.Len(t, got, 1, "one member of the group gets it: %v", got)
	for _, n := range got {
		require.Equal(t, 1, n, "once")
	}
}

// connectMembers connects a clean-session client for each name, each
// subscribed to the shared filter at QoS 2.
func connectMembers(t *testing.T, addr, filter string, names ...string) []*mqtttest.Client {
	t.Helper()
	var members []*mqtttest.Client
	for _, name := range names {
		c := mqtttest.Dial(t, addr, 5)
		c.Connect(name, true, packets.Properties{})
		c.Subscribe(1, filter, 2)
		members = append(members, c)
	}
	return members
}

// persistentSubscriber connects client with a persistent session
// subscribed to filter at QoS 2.
func persistentSubscriber(t *testing.T, addr, client, filter string) *mqtttest.Client {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	c.Connect(client, false, persistentProps)
	c.Subscribe(1, filter, 2)
	return c
}

// pickedMsg is a QoS 2 message with msgID seq whose member in group G
// was session.
func pickedMsg(seq uint64, session string) *Message {
	return &Message{ID: MsgID{Edge: "other", Incarnation: 1, Seq: seq}, QoS: 2,
		picks: []groupPick{{name: "G", filter: "g/#", session: session, qos: 2}}}
}

// The member of a group message that failed here is remembered for its
// resend however many QoS 2 group messages are delivered meanwhile: each
// of those is remembered too (its publisher may send it again), and above
// sharedPickMax of them within the forward bound they pushed the failed
// one's member out, and its resend went to a second member.
func TestSharedPicks_FailedPickOutlivesManyDeliveries(t *testing.T) {
	t.Parallel()
	b := &Broker{}
	failed := pickedMsg(1, "took-it")
	b.rememberDelivery(failed, errors.New("a relay failed"))
	for i := range uint64(sharedPickMax + 1) {
		b.rememberDelivery(pickedMsg(2+i, "other"), nil)
	}
	require.Equal(t, failed.picks, b.pickedBefore(failed.ID), "the failed message's member is remembered")
	delivered := pickedMsg(sharedPickMax+2, "")
	require.Equal(t, "other", b.pickedBefore(delivered.ID)[0].session, "and the last delivery's")
}

// A msgID forgotten (its publisher was acknowledged) and remembered again
// later is kept for sharedPickMemory from the second time: the first
// entry's expiry does not take the second with it. Remembered again
// without being forgotten, it is kept from the last time too.
func TestSharedPicks_RememberedAgainIsKeptFromThen(t *testing.T) {
	t.Parallel()
	for _, forget := range []bool{true, false} {
		t.Run(fmt.Sprintf("forget=%v", forget), func(t *testing.T) {
			t.Parallel()
			var p sharedPicks
			m := pickedMsg(1, "s")
			t0 := time.Now()
			p.rememberAt(t0, m.ID, m.picks, nil, nil)
			if forget {
				p.forget(m.ID)
			}
			t1 := t0.Add(sharedPickMemory / 2)
			p.rememberAt(t1, m.ID, m.picks, nil, nil)
			require.Equal(t, m.picks, p.lookupAt(t0.Add(sharedPickMemory), m.ID), "past the first entry's expiry")
			require.Nil(t, p.lookupAt(t1.Add(sharedPickMemory), m.ID), "past the second's")
		})
	}
}

// BenchmarkSharedPicks_Lookup looks up a msgID in a store of sharedPickMax
// messages, as every QoS 1/2 message delivered here does. expiring: one
// expires, and another is remembered, per lookup (the steady state of an
// edge remembering a few hundred QoS 2 group messages a second); full:
// nothing expires.
func BenchmarkSharedPicks_Lookup(b *testing.B) {
	picks := []groupPick{{name: "G", filter: "g/#", session: "s", qos: 2}}
	id := func(i int) MsgID { return MsgID{Edge: "other", Incarnation: 1, Seq: uint64(i + sharedPickMax)} }
	// The oldest expires as the next is remembered, before the bound
	// would push it out.
	tick := sharedPickMemory/sharedPickMax + 1
	base := time.Now()
	fill := func(p *sharedPicks) {
		for i := -sharedPickMax; i < 0; i++ {
			p.rememberAt(base.Add(time.Duration(i)*tick), id(i), picks, nil, nil)
		}
	}
	b.Run("expiring", func(b *testing.B) {
		var p sharedPicks
		fill(&p)
		b.ResetTimer()
		for i := range b.N {
			now := base.Add(time.Duration(i) * tick)
			if p.lookupAt(now, id(i-1)) == nil && i > 0 {
				b.Fatal("not found")
			}
			p.rememberAt(now, id(i), picks, nil, nil)
		}
	})
	b.Run("full", func(b *testing.B) {
		var p sharedPicks
		fill(&p)
		b.ResetTimer()
		for i := range b.N {
			if p.lookupAt(base.Add(-tick), id(-1-i%sharedPickMax)) == nil {
				b.Fatal("not found")
			}
		}
	})
}

// A QoS 2 group message delivered here whose member's deferred write
// then fails (DeliverForwarded returned before Deferred.Wait) never
// reached that member: it is not remembered as the member that took it,
// also not as that of a delivery.
func TestSharedPicks_DeliveredMemberWhoseWriteFailedIsForgotten(t *testing.T) {
	t.Parallel()
	b := &Broker{}
	m := pickedMsg(1, "failed-write")
	m.picks = append(m.picks, groupPick{name: "H", filter: "g/#", session: "wrote", qos: 2})
	b.rememberDelivery(m, nil)
	b.rememberFailed(m, []*session{{id: "failed-write"}})
	require.Equal(t, []groupPick{{name: "H", filter: "g/#", session: "wrote", qos: 2}}, b.pickedBefore(m.ID))
}

// received counts, by index in clients, the packets each reads until none
// comes for 300 ms; clients that read none are left out.
func received(clients []*mqtttest.Client) map[int]int {
	got := map[int]int{}
	for i, c := range clients {
		for {
			if _, err := c.Read(300 * time.Millisecond); err != nil {
				break
			}
			got[i]++
		}
	}
	return got
}
