package cluster

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
	"github.com/keelmq/keel/services/edge/internal/remotestore"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// sharedCluster is a coordinator, a router, a persistence instance
// (embedded store) and edges that keep their sessions in it.
type sharedCluster struct {
	edges   map[string]*sharedEdge
	persist string // the persistence service's URL
	// killPersistence kills the persistence service (SIGKILL), and
	// startPersistence starts it again on its address and data.
	killPersistence, startPersistence func()
}

type sharedEdge struct {
	mqtt, ops  string
	proc       *os.Process
	stop, kill func()
}

// startSharedCluster starts the services and the named edges. The lease is
// short so that a killed edge's sessions go to custodians within seconds.
func startSharedCluster(t *testing.T, ids ...string) *sharedCluster {
	t.Helper()
	return startSharedClusterWith(t, nil, ids...)
}

// startSharedClusterWith is startSharedCluster with extra flags for the
// persistence service.
func startSharedClusterWith(t *testing.T, persistArgs []string, ids ...string) *sharedCluster {
	t.Helper()
	dir := t.TempDir()
	routerBin := testutil.Build(t, dir, "./services/router/cmd/keel-router")
	persistBin := testutil.Build(t, dir, "./services/persistence/cmd/keel-persistence")
	edgeBin := testutil.Build(t, dir, "./services/edge/cmd/keel-edge")

	routerAPI, routerOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	startProcess(t, "router", routerBin, routerOps, "--api.addr", routerAPI, "--ops.addr", routerOps, "--olric.single-node",
		"--router.rebuild-wait", "200ms", "--olric.bind-addr", "127.0.0.1", "--olric.port", fmt.Sprint(testutil.FreePort(t)),
		"--olric.memberlist-port", fmt.Sprint(testutil.FreePort(t)), "--log.level", "warn")
	coordURL, _ := startCoordinator(t, 2*time.Second, "--router.url", "http://"+routerAPI, "--custody.route-grace", "500ms")
	persistAPI, persistOps, persistData := testutil.FreeAddr(t), testutil.FreeAddr(t), t.TempDir()
	c := &sharedCluster{edges: map[string]*sharedEdge{}, persist: "http://" + persistAPI}
	c.startPersistence = func() {
		_, c.killPersistence = startKillable(t, "persistence", persistBin, persistOps, append([]string{"--api.addr", persistAPI, "--ops.addr", persistOps,
			"--data-dir", persistData, "--log.level", "warn"}, persistArgs...)...)
	}
	c.startPersistence()

	for _, id := range ids {
		mqtt, ops, api := testutil.FreeAddr(t), testutil.FreeAddr(t), testutil.FreeAddr(t)
		proc, stop, kill := startProc(t, id, edgeBin, ops, "--auth.anonymous", "--mqtt.tcp-addr", mqtt, "--mqtt.ws-addr", "",
			"--ops.addr", ops, "--data-dir", t.TempDir(), "--mqtt.edge-id", id, "--log.level", "warn",
			"--cluster.coordinator", coordURL, "--cluster.router", "http://"+routerAPI, "--cluster.api-addr", api,
			"--cluster.persistence", "http://"+persistAPI, "--cluster.forward-timeout", "2s")
		c.edges[id] = &sharedEdge{mqtt: mqtt, ops: ops, proc: proc, stop: stop, kill: kill}
	}
	return c
}

var sessionProps = packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true}

// publishAcked publishes payload at QoS 1 through a new connection to addr
// until a PUBACK comes back: a publish that finds no live holder of a
// matching session is not acknowledged (the edge closes the publisher).
func publishAcked(t *testing.T, addr, topic string, payload []byte, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for attempt := 1; ; attempt++ {
		c := mqtttest.Dial(t, addr, 5)
		if c.Connect("publisher-"+strconv.Itoa(attempt), true, packets.Properties{}).ReasonCode == packets.CodeSuccess.Code {
			c.Publish(1, topic, 1, payload)
			for {
				pk, err := c.Read(3 * time.Second)
				if err != nil {
					break
				}
				if pk.FixedHeader.Type == packets.Puback {
					_ = c.Conn.Close()
					return
				}
			}
		}
		_ = c.Conn.Close()
		require.True(t, time.Now().Before(deadline), "publish of %q never acknowledged", payload)
		time.Sleep(200 * time.Millisecond)
	}
}

// connectResumed connects id to addr with clean start off until the edge
// admits it (it refuses while the session's previous owner may still hold
// it), and requires the session to be present.
func connectResumed(t *testing.T, addr, id string, within time.Duration) *mqtttest.Client {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		c := mqtttest.Dial(t, addr, 5)
		ack := c.Connect(id, false, sessionProps)
		if ack.ReasonCode == packets.CodeSuccess.Code {
			require.True(t, ack.SessionPresent, "%s: the session is resumed", id)
			return c
		}
		_ = c.Conn.Close()
		require.True(t, time.Now().Before(deadline), "%s not admitted: 0x%x", id, ack.ReasonCode)
		time.Sleep(200 * time.Millisecond)
	}
}

// persistentSubscriber connects id to addr with a persistent session
// subscribed to prefix/# at QoS 1, and waits until a message published
// through pubAddr (payload first) reaches it: routed and stored.
func persistentSubscriber(t *testing.T, addr, id, prefix, pubAddr, first string) *mqtttest.Client {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	c.Connect(id, true, sessionProps)
	require.Equal(t, []byte{1}, c.Subscribe(1, prefix+"/#", 1).ReasonCodes)
	publishAcked(t, pubAddr, prefix+"/x", []byte(first), 10*time.Second)
	require.Equal(t, []string{first}, receive(t, c, []string{first}))
	return c
}

// connectRefused requires a CONNECT of id to addr, clean start off, to be
// refused. The answer can take the edge's whole connect timeout (10 s): a
// takeover from an edge that cannot reach the store may fail only then.
func connectRefused(t *testing.T, addr, id string) {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	defer c.Conn.Close()
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect:    packets.ConnectParams{ProtocolName: []byte("MQTT"), Keepalive: 30, ClientIdentifier: id},
		Properties: sessionProps})
	ack, err := c.Read(20 * time.Second)
	require.NoError(t, err, "CONNACK for %s", id)
	require.Equal(t, packets.Connack, ack.FixedHeader.Type)
	require.NotEqual(t, packets.CodeSuccess.Code, ack.ReasonCode)
}

// receive reads PUBLISHes, acknowledging each, until every payload in want
// arrived (duplicates of QoS 1 messages are allowed), and returns them in
// arrival order.
func receive(t *testing.T, c *mqtttest.Client, want []string) []string {
	t.Helper()
	missing := map[string]bool{}
	for _, w := range want {
		missing[w] = true
	}
	var got []string
	for len(missing) > 0 {
		pk := c.Expect(packets.Publish)
		got = append(got, string(pk.Payload))
		delete(missing, string(pk.Payload))
		c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	}
	return got
}

func payloads(prefix string, from, to int) []string {
	var out []string
	for i := from; i < to; i++ {
		out = append(out, prefix+strconv.Itoa(i))
	}
	return out
}

// TestCluster_SharedStore: with sessions in the persistence service, a
// persistent session moves between live edges with its queue; and when an
// edge is killed, a session that was connected there resumes on another
// edge from the store (with its unacknowledged in-flight message sent
// again), while an offline one is adopted by a custodian edge, which
// queues for it until its client comes back. No acknowledged message is
// lost.
func TestCluster_SharedStore(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b", "edge-c")
	a, b, cc := c.edges["edge-a"], c.edges["edge-b"], c.edges["edge-c"]

	// A live move: queued on edge A while away, delivered on edge B.
	mover := mqtttest.Dial(t, a.mqtt, 5)
	mover.Connect("mover", true, sessionProps)
	require.Equal(t, []byte{1}, mover.Subscribe(1, "move/#", 1).ReasonCodes)
	mover.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	for _, p := range payloads("m", 0, 10) {
		publishAcked(t, cc.mqtt, "move/x", []byte(p), 10*time.Second)
	}
	moved := connectResumed(t, b.mqtt, "mover", 10*time.Second)
	require.Equal(t, payloads("m", 0, 10), receive(t, moved, payloads("m", 0, 10)), "the queue came along, in order")
	publishAcked(t, cc.mqtt, "move/x", []byte("m10"), 10*time.Second)
	require.Equal(t, []string{"m10"}, receive(t, moved, []string{"m10"}))

	// Edge A dies with a connected session whose client holds one message
	// unacknowledged, and an offline one.
	online := mqtttest.Dial(t, a.mqtt, 5)
	online.Connect("online", true, sessionProps)
	require.Equal(t, []byte{1}, online.Subscribe(1, "crash/#", 1).ReasonCodes)
	offline := mqtttest.Dial(t, a.mqtt, 5)
	offline.Connect("offline", true, sessionProps)
	require.Equal(t, []byte{1}, offline.Subscribe(1, "crash/#", 1).ReasonCodes)
	offline.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	for _, p := range payloads("k", 0, 5) {
		publishAcked(t, cc.mqtt, "crash/x", []byte(p), 10*time.Second)
	}
	require.Equal(t, payloads("k", 0, 4), receive(t, online, payloads("k", 0, 4)))
	require.Equal(t, "k4", string(online.Expect(packets.Publish).Payload)) // never acknowledged
	// A PUBACK on the wire is not one the edge has read: give the four
	// acknowledgements time to reach the store, or they come again (QoS 1
	// allows that, but this test checks the in-flight message's turn).
	time.Sleep(time.Second)
	killed := time.Now()
	a.kill()

	// Published while edge A is dead: acknowledged only once a live edge
	// holds the sessions (custody, or the online client's return).
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, p := range payloads("k", 5, 10) {
			publishAcked(t, cc.mqtt, "crash/x", []byte(p), 30*time.Second)
		}
	}()
	back := connectResumed(t, b.mqtt, "online", 30*time.Second)
	t.Logf("online resumed %v after the kill", time.Since(killed).Round(10*time.Millisecond))
	<-done
	t.Logf("publishes acknowledged again %v after the kill", time.Since(killed).Round(10*time.Millisecond))
	got := receive(t, back, payloads("k", 4, 10))
	require.Equal(t, "k4", got[0], "the unacknowledged in-flight message is sent first")

	offBack := connectResumed(t, b.mqtt, "offline", 10*time.Second)
	got = receive(t, offBack, payloads("k", 0, 10))
	require.Equal(t, payloads("k", 0, 5), got[:5], "queued before the kill, in order")
}

// connectWithWill connects id to addr with a will of payload on topic
// will/<id> at QoS 1; expiry is its session expiry interval (MQTT 5).
func connectWithWill(t *testing.T, addr, id string, expiry, delay uint32) *mqtttest.Client {
	t.Helper()
	c := mqtttest.Dial(t, addr, 5)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: id,
			WillFlag: true, WillTopic: "will/" + id, WillQos: 1, WillPayload: []byte(id + " is gone"),
			WillProperties: packets.Properties{WillDelayInterval: delay}},
		Properties: packets.Properties{SessionExpiryInterval: expiry, SessionExpiryIntervalFlag: expiry > 0}})
	require.Equal(t, packets.CodeSuccess.Code, c.Expect(packets.Connack).ReasonCode)
	return c
}

// TestCluster_WillsOfAKilledEdge: when an edge dies, the wills of its
// clients are published once, by the custodians of their sessions: at once
// for a session that ended with its connection, after the will delay for a
// persistent one, and never for a client that said DISCONNECT or came back
// within the delay.
func TestCluster_WillsOfAKilledEdge(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b", "edge-c")
	a, b, cc := c.edges["edge-a"], c.edges["edge-b"], c.edges["edge-c"]

	watcher := mqtttest.Dial(t, cc.mqtt, 5)
	watcher.Connect("watcher", true, packets.Properties{})
	require.Equal(t, []byte{1}, watcher.Subscribe(1, "will/#", 1).ReasonCodes)

	connectWithWill(t, a.mqtt, "ephemeral", 0, 0)    // ends with its connection
	connectWithWill(t, a.mqtt, "persistent", 300, 2) // outlives it; will after 2 s
	connectWithWill(t, a.mqtt, "returning", 300, 6)  // comes back within the delay
	polite := connectWithWill(t, a.mqtt, "polite", 0, 0)
	polite.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	// A normal DISCONNECT clears the stored will; give it time to land.
	time.Sleep(500 * time.Millisecond)
	killed := time.Now()
	a.kill()

	// The returning client is back as soon as edge A's lease lets it in.
	connectResumed(t, b.mqtt, "returning", 30*time.Second)

	got := map[string]int{}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && (got["will/ephemeral"] == 0 || got["will/persistent"] == 0) {
		pk, err := watcher.Read(time.Second)
		if err != nil || pk.FixedHeader.Type != packets.Publish {
			continue
		}
		got[pk.TopicName]++
		t.Logf("%s published %v after the kill", pk.TopicName, time.Since(killed).Round(10*time.Millisecond))
		watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	}
	// Anything more would be a duplicate, or a will that must not go out:
	// watch until the returning client's will delay has passed however late
	// its custody began (the lease is 2 s).
	for quiet := time.Now().Add(3 * time.Second); time.Now().Before(quiet) || time.Since(killed) < 12*time.Second; {
		pk, err := watcher.Read(time.Second)
		if err != nil {
			continue
		}
		if pk.FixedHeader.Type == packets.Publish {
			got[pk.TopicName]++
			watcher.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
	}
	require.Equal(t, map[string]int{"will/ephemeral": 1, "will/persistent": 1}, got)
}

// TestCluster_FencedSessionGivenUp: when the store refuses an edge's write
// for a session as fenced (a newer owner activated it, here directly in
// the store), the edge gives its copy up: its client is disconnected with
// 0x8E and its routes go, so publishers are acknowledged again at once
// instead of failing on it until the session moves on.
func TestCluster_FencedSessionGivenUp(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b")
	a, b := c.edges["edge-a"], c.edges["edge-b"]

	holder := persistentSubscriber(t, a.mqtt, "holder", "fence", b.mqtt, "before")

	// A newer owner, as far as the store knows.
	st, err := remotestore.New(remotestore.Config{URL: c.persist})
	require.NoError(t, err)
	t.Cleanup(func() { _ = st.Close() })
	sc, err := tenancy.NewScope("default")
	require.NoError(t, err)
	require.NoError(t, st.Activate(t.Context(), sc.ClientID("holder"), 1<<40))

	start := time.Now()
	publishAcked(t, b.mqtt, "fence/x", []byte("after"), 20*time.Second)
	t.Logf("publishes acknowledged again %v after the fence", time.Since(start).Round(10*time.Millisecond))
	for {
		pk, err := holder.Read(5 * time.Second)
		require.NoError(t, err, "the fenced copy's client is disconnected")
		if pk.FixedHeader.Type == packets.Disconnect {
			require.Equal(t, packets.ErrSessionTakenOver.Code, pk.ReasonCode)
			break
		}
	}
}

// TestCluster_FailedTakeoverAdoptedWhenOwnerLeaves: a client that tries
// another edge while its dead edge's lease still runs makes that edge the
// session's owner at the coordinator, but the takeover fails and the
// CONNECT is refused. When the dead edge leaves the membership, the new
// owner adopts the session from the store, so what is published before
// the client comes back is queued for it, not acknowledged to nobody once
// the dead edge's routes are gone.
func TestCluster_FailedTakeoverAdoptedWhenOwnerLeaves(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b", "edge-c")
	a, b, cc := c.edges["edge-a"], c.edges["edge-b"], c.edges["edge-c"]

	persistentSubscriber(t, a.mqtt, "racer", "race", cc.mqtt, "r0")
	a.kill()
	// At once, while edge A's lease runs: edge B claims, cannot reach A,
	// refuses the CONNECT.
	connectRefused(t, b.mqtt, "racer")
	// The lease expires, custody passes the session by, A's routes go.
	time.Sleep(5 * time.Second)
	want := payloads("r", 1, 6)
	for _, p := range want {
		publishAcked(t, cc.mqtt, "race/x", []byte(p), 20*time.Second)
	}
	back := connectResumed(t, b.mqtt, "racer", 20*time.Second)
	// r0 may come again: its PUBACK may not have reached the store.
	got := slices.DeleteFunc(receive(t, back, want), func(p string) bool { return p == "r0" })
	require.Equal(t, want, got, "queued while the client was away, in order")
}

// TestCluster_TakeoverFollowsTheHolder: a client that tries edge B while
// the store is down makes B the session's owner at the coordinator, but
// B's takeover from edge A fails, so the session stays on A. When the
// client then connects to edge C, C is told B's previous owner is B; B
// holds no copy and names A, and C takes the session over from A, with
// what A queued. Resumed from the store beside A's copy instead, the
// session would keep its routes on A too, and a message routed only there
// before C's routes were in place would be lost when the store fenced A's
// copy.
func TestCluster_TakeoverFollowsTheHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b", "edge-c")
	a, b, cc := c.edges["edge-a"], c.edges["edge-b"], c.edges["edge-c"]

	persistentSubscriber(t, a.mqtt, "mover", "move", cc.mqtt, "m0")

	// With the store down, A cannot hand the session over: B's CONNECT is
	// refused, and the session stays on A, owned by B at the coordinator.
	c.killPersistence()
	connectRefused(t, b.mqtt, "mover")
	c.startPersistence()

	// Queued on A, which still holds the session.
	want := payloads("m", 1, 4)
	for _, p := range want {
		publishAcked(t, cc.mqtt, "move/x", []byte(p), 20*time.Second)
	}
	back := connectResumed(t, cc.mqtt, "mover", 20*time.Second)
	require.Equal(t, want, slices.DeleteFunc(receive(t, back, want), func(p string) bool { return p == "m0" }))

	publishAcked(t, b.mqtt, "move/x", []byte("m4"), 20*time.Second)
	require.Equal(t, []string{"m4"}, receive(t, back, []string{"m4"}))
	require.Zero(t, testutil.Metric(t, a.ops, "keel_edge_sessions_fenced_total"), "A's copy went with the takeover, not when the store fenced it")
	require.Equal(t, 1.0, testutil.Metric(t, cc.ops, "keel_edge_takeover_redirects_total"), "B named A as holding the session")
}

// TestCluster_RejoinedEdgeDropsLapsedSessions: an edge stalled past its
// lease (SIGSTOP) loses its sessions to custodians; when it runs again it
// fences itself, rejoins under a new incarnation and drops its copies of
// them, so none of them registers its routes again there to draw messages it
// could not store. The session's client finds it, with everything published
// meanwhile, on another edge.
func TestCluster_RejoinedEdgeDropsLapsedSessions(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b", "edge-c")
	a, b, cc := c.edges["edge-a"], c.edges["edge-b"], c.edges["edge-c"]

	sub := persistentSubscriber(t, a.mqtt, "lapser", "lapse", cc.mqtt, "l0")

	// Stalled past its 2 s lease: the coordinator expires it and hands the
	// session to a custodian.
	require.NoError(t, a.proc.Signal(syscall.SIGSTOP))
	time.Sleep(6 * time.Second)
	require.NoError(t, a.proc.Signal(syscall.SIGCONT))
	testutil.Eventually(t, 20*time.Second, func() error {
		if n := testutil.Metric(t, a.ops, "keel_edge_lapsed_sessions_dropped_total"); n < 1 {
			return fmt.Errorf("%v lapsed sessions dropped", n)
		}
		return nil
	})
	_ = sub.Conn.Close()

	want := payloads("l", 1, 6)
	for _, p := range want {
		publishAcked(t, cc.mqtt, "lapse/x", []byte(p), 20*time.Second)
	}
	require.Zero(t, testutil.Metric(t, a.ops, "keel_edge_sessions_fenced_total"), "no stale copy on the rejoined edge drew a message")
	back := connectResumed(t, b.mqtt, "lapser", 20*time.Second)
	got := slices.DeleteFunc(receive(t, back, want), func(p string) bool { return p == "l0" })
	require.Equal(t, want, got, "queued by the custodian while the client was away, in order")
}
