package cluster

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/keelmq/keel/libs/testutil"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// startProcess runs bin with args and waits for /readyz on ops. The
// returned stop sends SIGTERM and waits (killing after 20 s); cleanup calls
// it too, and shows the logs when the test failed.
func startProcess(t *testing.T, name, bin, ops string, args ...string) (stop func()) {
	t.Helper()
	stop, _ = startKillable(t, name, bin, ops, args...)
	return stop
}

// startKillable is startProcess that can also kill the process (SIGKILL:
// no graceful stop).
func startKillable(t *testing.T, name, bin, ops string, args ...string) (stop, kill func()) {
	t.Helper()
	_, stop, kill = startProc(t, name, bin, ops, args...)
	return stop, kill
}

// withTestLogLevel appends --log.level $KEEL_TEST_LOG_LEVEL when it is set
// (the last flag wins), so a failing run can be repeated with debug logs.
func withTestLogLevel(args []string) []string {
	if level := os.Getenv("KEEL_TEST_LOG_LEVEL"); level != "" {
		return append(slices.Clip(args), "--log.level", level)
	}
	return args
}

// startProc is startKillable that also returns the process, for signals.
func startProc(t *testing.T, name, bin, ops string, args ...string) (proc *os.Process, stop, kill func()) {
	t.Helper()
	cmd := exec.Command(bin, withTestLogLevel(args)...)
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	var once sync.Once
	stop = func() {
		once.Do(func() {
			_ = cmd.Process.Signal(syscall.SIGTERM)
			done := make(chan struct{})
			go func() { _ = cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(20 * time.Second):
				t.Logf("%s did not stop within 20s of SIGTERM; killed", name)
				_ = cmd.Process.Kill()
				<-done
			}
		})
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			t.Logf("%s logs:\n%s", name, logs.String())
		}
	})
	testutil.Eventually(t, 30*time.Second, func() error {
		resp, err := http.Get("http://" + ops + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s readyz %d", name, resp.StatusCode)
		}
		return nil
	})
	kill = func() {
		_ = cmd.Process.Kill()
		stop()
	}
	return cmd.Process, stop, kill
}

// TestCluster_CrossEdgePubSub runs a coordinator, a router and two edges as
// processes. A subscriber on edge B gets its SUBACK once the route is at the
// router; a QoS 1 publish on edge A afterwards reaches it through forwarding,
// and A's PUBACK comes only after B took the message.
func TestCluster_CrossEdgePubSub(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	coordURL, _ := startCoordinator(t, 10*time.Second)
	dir := t.TempDir()
	router := testutil.Build(t, dir, "./services/router/cmd/keel-router")
	edgeBin := testutil.Build(t, dir, "./services/edge/cmd/keel-edge")

	routerAPI, routerOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	// The edges start after the router here, so its new table has nobody to
	// wait for (router.rebuild-wait).
	startProcess(t, "router", router, routerOps, "--api.addr", routerAPI, "--ops.addr", routerOps, "--olric.single-node", "--router.rebuild-wait", "200ms",
		"--olric.bind-addr", "127.0.0.1", "--olric.port", fmt.Sprint(testutil.FreePort(t)),
		"--olric.memberlist-port", fmt.Sprint(testutil.FreePort(t)), "--log.level", "warn")

	// Two tenants with the same user name, besides anonymous clients in
	// "default".
	hash, err := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost)
	require.NoError(t, err)
	users := filepath.Join(dir, "users.yaml")
	require.NoError(t, os.WriteFile(users, fmt.Appendf(nil, `tenants:
  acme:
    users:
      dev: {password: %q, acl: {publish: ["#"], subscribe: ["#"]}}
  globex:
    users:
      dev: {password: %q, acl: {publish: ["#"], subscribe: ["#"]}}
`, hash, hash), 0o600))

	type edgeProc struct {
		mqtt string
		stop func()
	}
	start := func(id string) edgeProc {
		mqtt, ops, api := testutil.FreeAddr(t), testutil.FreeAddr(t), testutil.FreeAddr(t)
		stop := startProcess(t, id, edgeBin, ops, "--auth.anonymous", "--auth.file", users, "--mqtt.tcp-addr", mqtt, "--mqtt.ws-addr", "",
			"--ops.addr", ops, "--data-dir", t.TempDir(), "--mqtt.edge-id", id, "--log.level", "warn",
			"--cluster.coordinator", coordURL, "--cluster.router", "http://"+routerAPI, "--cluster.api-addr", api,
			"--cluster.forward-timeout", "5s")
		return edgeProc{mqtt: mqtt, stop: stop}
	}
	a, b := start("edge-a"), start("edge-b")

	sub := mqtttest.Dial(t, b.mqtt, 5)
	sub.Connect("sub", true, packets.Properties{})
	require.Equal(t, []byte{1}, sub.Subscribe(1, "sensors/#", 1).ReasonCodes)

	pub := mqtttest.Dial(t, a.mqtt, 4)
	pub.Connect("pub", true, packets.Properties{})
	const n = 50
	for i := range n {
		pub.Publish(uint16(i+1), "sensors/x", 1, []byte{byte(i)})
		require.Equal(t, uint16(i+1), pub.Expect(packets.Puback).PacketID)
	}
	// Pipelined: every PUBLISH is on the wire before the first
	// acknowledgement, which still come back in order. QoS 2 completes
	// through PUBREL/PUBCOMP on edge A.
	for i := n; i < 3*n; i++ {
		qos := byte(1 + (i-n)/n)
		pub.Publish(uint16(i+1), "sensors/x", qos, []byte{byte(i)})
	}
	for i := n; i < 2*n; i++ {
		require.Equal(t, uint16(i+1), pub.Expect(packets.Puback).PacketID)
	}
	for i := 2 * n; i < 3*n; i++ {
		require.Equal(t, uint16(i+1), pub.Expect(packets.Pubrec).PacketID)
	}
	for i := 2 * n; i < 3*n; i++ {
		pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: uint16(i + 1)})
		require.Equal(t, uint16(i+1), pub.Expect(packets.Pubcomp).PacketID)
	}
	for i := range 3 * n {
		got := sub.Expect(packets.Publish)
		require.Equal(t, []byte{byte(i)}, got.Payload, "message %d once, in order", i)
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
	_, err = sub.Read(200 * time.Millisecond)
	require.Error(t, err, "nothing after the last message")

	// A session that ends gives up its ownership at the coordinator; a
	// persistent one keeps it while offline.
	coord := NewClient(coordURL)
	owner := func(id string) string {
		resp, err := coord.GetSession(t.Context(), connect.NewRequest(&coordinatorv1.GetSessionRequest{
			Session: &commonv1.SessionKey{Tenant: "default", ClientId: id}}))
		require.NoError(t, err)
		return resp.Msg.GetSession().GetOwnerEdgeId()
	}
	clean := mqtttest.Dial(t, a.mqtt, 5)
	clean.Connect("clean", true, packets.Properties{})
	kept := mqtttest.Dial(t, a.mqtt, 5)
	kept.Connect("kept", true, packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true})
	require.Equal(t, "edge-a", owner("clean"))
	require.Equal(t, "edge-a", owner("kept"))
	clean.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	kept.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	testutil.Eventually(t, 10*time.Second, func() error {
		if o := owner("clean"); o != "" {
			return fmt.Errorf("clean session still owned by %q", o)
		}
		return nil
	})
	require.Equal(t, "edge-a", owner("kept"))

	// One live connection per client ID across the cluster: connecting on
	// edge B closes the connection on edge A with 0x8E.
	first := mqtttest.Dial(t, a.mqtt, 5)
	first.Connect("roamer", true, packets.Properties{})
	second := mqtttest.Dial(t, b.mqtt, 5)
	require.Equal(t, packets.CodeSuccess.Code, second.Connect("roamer", true, packets.Properties{}).ReasonCode)
	require.Equal(t, packets.ErrSessionTakenOver.Code, first.Expect(packets.Disconnect).ReasonCode)
	require.Equal(t, "edge-b", owner("roamer"))
	second.Subscribe(1, "roam", 1)
	pub.Publish(200, "roam", 1, []byte("here"))
	require.Equal(t, uint16(200), pub.Expect(packets.Puback).PacketID)
	require.Equal(t, []byte("here"), second.Expect(packets.Publish).Payload)

	// Tenants stay apart across edges: the same client ID in two tenants is
	// two sessions (no takeover, even across edges), and a message reaches
	// only its own tenant's subscribers on the other edge.
	tenantSub := map[string]*mqtttest.Client{}
	for _, tenant := range []string{"acme", "globex"} {
		c := mqtttest.Dial(t, b.mqtt, 5)
		require.Equal(t, packets.CodeSuccess.Code, c.ConnectAs("same", "dev@"+tenant, "pw", true, packets.Properties{}).ReasonCode)
		require.Equal(t, []byte{1}, c.Subscribe(1, "iso/#", 1).ReasonCodes)
		tenantSub[tenant] = c
	}
	other := mqtttest.Dial(t, a.mqtt, 5) // "same" of a third tenant, on edge A
	require.Equal(t, packets.CodeSuccess.Code, other.Connect("same", true, packets.Properties{}).ReasonCode)
	for k, tenant := range []string{"acme", "globex"} {
		c := mqtttest.Dial(t, a.mqtt, 5)
		require.Equal(t, packets.CodeSuccess.Code, c.ConnectAs("publisher", "dev@"+tenant, "pw", true, packets.Properties{}).ReasonCode)
		c.Publish(uint16(k+1), "iso/x", 1, []byte(tenant))
		require.Equal(t, uint16(k+1), c.Expect(packets.Puback).PacketID)
	}
	for tenant, c := range tenantSub {
		got := c.Expect(packets.Publish)
		require.Equal(t, tenant, string(got.Payload), "%s's subscriber gets its own tenant's message", tenant)
		require.Equal(t, "iso/x", got.TopicName)
		c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
		_, err := c.Read(300 * time.Millisecond)
		require.Error(t, err, "%s's subscriber gets nothing from the other tenant (and stays connected)", tenant)
	}

	// Retained messages, wills and shared groups keep to their tenant across
	// edges too: same topics, same group name, same client IDs.
	for k, tenant := range []string{"acme", "globex"} {
		c := mqtttest.Dial(t, a.mqtt, 5)
		require.Equal(t, packets.CodeSuccess.Code, c.ConnectAs("publisher", "dev@"+tenant, "pw", true, packets.Properties{}).ReasonCode)
		c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true},
			TopicName: "iso/r", PacketID: uint16(10 + k), Payload: []byte(tenant + "-retained")})
		require.Equal(t, uint16(10+k), c.Expect(packets.Puback).PacketID)
	}
	tenantShare := map[string]*mqtttest.Client{}
	for _, tenant := range []string{"acme", "globex"} {
		// A new subscription on edge B gets its tenant's retained message only.
		late := mqtttest.Dial(t, b.mqtt, 5)
		require.Equal(t, packets.CodeSuccess.Code, late.ConnectAs("late", "dev@"+tenant, "pw", true, packets.Properties{}).ReasonCode)
		require.Equal(t, []byte{1}, late.Subscribe(1, "iso/r", 1).ReasonCodes)
		got := late.Expect(packets.Publish)
		require.Equal(t, tenant+"-retained", string(got.Payload))
		require.True(t, got.FixedHeader.Retain)
		late.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
		_, err := late.Read(300 * time.Millisecond)
		require.Error(t, err, "%s gets no other tenant's retained message", tenant)
		// One shared group of the same name per tenant, its member on edge A.
		m := mqtttest.Dial(t, a.mqtt, 5)
		require.Equal(t, packets.CodeSuccess.Code, m.ConnectAs("member", "dev@"+tenant, "pw", true, packets.Properties{}).ReasonCode)
		require.Equal(t, []byte{1}, m.Subscribe(1, "$share/g/iso/will", 1).ReasonCodes)
		tenantShare[tenant] = m
	}
	// acme's client on edge B dies without DISCONNECT: its will goes to
	// acme's share group member on edge A, not to globex's.
	willer := mqtttest.Dial(t, b.mqtt, 5)
	willer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: "willer",
			UsernameFlag: true, Username: []byte("dev@acme"), PasswordFlag: true, Password: []byte("pw"),
			WillFlag: true, WillTopic: "iso/will", WillQos: 1, WillPayload: []byte("acme-will")}})
	require.Equal(t, packets.CodeSuccess.Code, willer.Expect(packets.Connack).ReasonCode)
	_ = willer.Conn.Close()
	will := tenantShare["acme"].Expect(packets.Publish)
	require.Equal(t, "acme-will", string(will.Payload))
	tenantShare["acme"].Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: will.PacketID})
	_, err = tenantShare["globex"].Read(300 * time.Millisecond)
	require.Error(t, err, "globex's member gets nothing of acme's will")

	// A shared group with members on both edges: each message goes to one
	// member in the cluster, and the edges take turns.
	m1 := mqtttest.Dial(t, a.mqtt, 5)
	m1.Connect("member-1", true, packets.Properties{})
	require.Equal(t, []byte{1}, m1.Subscribe(1, "$share/workers/jobs/#", 1).ReasonCodes)
	m2 := mqtttest.Dial(t, b.mqtt, 5)
	m2.Connect("member-2", true, packets.Properties{})
	require.Equal(t, []byte{1}, m2.Subscribe(1, "$share/workers/jobs/#", 1).ReasonCodes)
	const jobs = 40
	for i := range jobs {
		pub.Publish(uint16(300+i), "jobs/x", 1, []byte{byte(i)})
		require.Equal(t, uint16(300+i), pub.Expect(packets.Puback).PacketID)
	}
	got := map[byte]int{}
	perMember := [2]int{}
	for k, m := range []*mqtttest.Client{m1, m2} {
		for {
			pk, err := m.Read(500 * time.Millisecond)
			if err != nil {
				break
			}
			if pk.FixedHeader.Type != packets.Publish {
				continue
			}
			got[pk.Payload[0]]++
			perMember[k]++
			m.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
	}
	require.Len(t, got, jobs, "every job delivered")
	for job, n := range got {
		require.Equal(t, 1, n, "job %d delivered once in the group", job)
	}
	require.Positive(t, perMember[0], "edge A's member got a share")
	require.Positive(t, perMember[1], "edge B's member got a share")

	// A member that leaves without acknowledging its share: its messages go
	// to the member on the other edge, each once.
	leaver := mqtttest.Dial(t, a.mqtt, 5)
	leaver.Connect("relay-leaver", true, packets.Properties{})
	require.Equal(t, []byte{1}, leaver.Subscribe(1, "$share/relay/relay/#", 1).ReasonCodes)
	stayer := mqtttest.Dial(t, b.mqtt, 5)
	stayer.Connect("relay-stayer", true, packets.Properties{})
	require.Equal(t, []byte{1}, stayer.Subscribe(1, "$share/relay/relay/#", 1).ReasonCodes)
	for i := range jobs {
		pub.Publish(uint16(400+i), "relay/x", 1, []byte{byte(i)})
		require.Equal(t, uint16(400+i), pub.Expect(packets.Puback).PacketID)
	}
	held := 0
	for {
		pk, err := leaver.Read(500 * time.Millisecond)
		if err != nil {
			break
		}
		if pk.FixedHeader.Type == packets.Publish {
			held++ // never acknowledged
		}
	}
	require.Positive(t, held, "edge A's member got a share")
	_ = leaver.Conn.Close()
	relayed := map[byte]int{}
	for len(relayed) < jobs {
		pk, err := stayer.Read(10 * time.Second)
		require.NoError(t, err, "edge B's member got %d of %d jobs", len(relayed), jobs)
		if pk.FixedHeader.Type != packets.Publish {
			continue
		}
		relayed[pk.Payload[0]]++
		stayer.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
	}
	if pk, err := stayer.Read(500 * time.Millisecond); err == nil && pk.FixedHeader.Type == packets.Publish {
		relayed[pk.Payload[0]]++
	}
	for job, n := range relayed {
		require.Equal(t, 1, n, "job %d delivered once in the group", job)
	}

	// A persistent session moves to the edge its client comes back to, with
	// what was queued for it while away and what kept arriving during the
	// takeover: every acknowledged message arrives, in order.
	persistent := packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true}
	mover := mqtttest.Dial(t, a.mqtt, 5)
	mover.Connect("mover", false, persistent)
	require.Equal(t, []byte{1}, mover.Subscribe(1, "move/#", 1).ReasonCodes)
	mover.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})

	flow := mqtttest.Dial(t, a.mqtt, 5)
	flow.Connect("flow", true, packets.Properties{})
	stop := make(chan struct{})
	acked := make(chan int, 1)
	go func() {
		k := 0
		defer func() { acked <- k }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			flow.Publish(uint16(k%60000+1), "move/x", 1, []byte(fmt.Sprint(k)))
			pk, err := flow.Read(5 * time.Second)
			if err != nil || pk.FixedHeader.Type != packets.Puback {
				return
			}
			k++
		}
	}()
	time.Sleep(300 * time.Millisecond) // queued on edge A while away
	back := mqtttest.Dial(t, b.mqtt, 5)
	ack := back.Connect("mover", false, persistent)
	require.Equal(t, packets.CodeSuccess.Code, ack.ReasonCode)
	require.True(t, ack.SessionPresent, "the session came along")
	time.Sleep(300 * time.Millisecond) // live on edge B
	close(stop)
	sent := <-acked
	require.Positive(t, sent)
	require.Equal(t, "edge-b", owner("mover"))
	next := 0
	for next < sent {
		pk := back.Expect(packets.Publish)
		got := 0
		_, err := fmt.Sscan(string(pk.Payload), &got)
		require.NoError(t, err)
		require.LessOrEqual(t, got, next, "message %d lost (got %d)", next, got)
		if got == next {
			next++
		}
		if pk.FixedHeader.Qos > 0 {
			back.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
	}

	// An edge that stops (SIGTERM) hands its persistent sessions to another
	// edge first: the client finds its session, and what was queued for it,
	// on the edge that remains.
	away := mqtttest.Dial(t, a.mqtt, 5)
	away.Connect("away", false, persistent)
	require.Equal(t, []byte{1}, away.Subscribe(1, "drain/#", 1).ReasonCodes)
	away.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	online := mqtttest.Dial(t, a.mqtt, 5)
	online.Connect("online", false, persistent)
	require.Equal(t, []byte{1}, online.Subscribe(1, "drain/#", 1).ReasonCodes)
	feeder := mqtttest.Dial(t, b.mqtt, 5)
	feeder.Connect("feeder", true, packets.Properties{})
	for i := range 10 {
		feeder.Publish(uint16(i+1), "drain/x", 1, []byte{byte(i)})
		require.Equal(t, uint16(i+1), feeder.Expect(packets.Puback).PacketID)
	}
	a.stop()
	require.Equal(t, packets.ErrServerShuttingDown.Code, online.Expect(packets.Disconnect).ReasonCode)
	require.Equal(t, "edge-b", owner("away"))
	require.Equal(t, "edge-b", owner("online"))
	for k, id := range []string{"away", "online"} {
		c := mqtttest.Dial(t, b.mqtt, 5)
		ack := c.Connect(id, false, persistent)
		require.True(t, ack.SessionPresent, "%s: session handed over", id)
		queued := map[byte]bool{}
		for len(queued) < 10 {
			pk := c.Expect(packets.Publish)
			c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
			if pk.Payload[0] < 10 {
				queued[pk.Payload[0]] = true
			}
		}
		live := byte(100 + k)
		feeder.Publish(uint16(live), "drain/x", 1, []byte{live})
		require.Equal(t, uint16(live), feeder.Expect(packets.Puback).PacketID)
		for {
			pk := c.Expect(packets.Publish)
			if pk.Payload[0] == live {
				break // the session's routes moved along
			}
			c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID})
		}
	}
}
