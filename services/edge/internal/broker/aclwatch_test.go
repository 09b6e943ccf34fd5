package broker

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// aclFile writes a password file with user alice (password "pw") in tenant
// acme, allowed to publish and subscribe to patterns.
func aclFile(t *testing.T, path string, patterns ...string) {
	t.Helper()
	hash, err := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost)
	require.NoError(t, err)
	list := "["
	for i, p := range patterns {
		if i > 0 {
			list += ", "
		}
		list += fmt.Sprintf("%q", p)
	}
	list += "]"
	require.NoError(t, os.WriteFile(path, fmt.Appendf(nil, `tenants:
  acme:
    users:
      alice: {password: %q, acl: {publish: %s, subscribe: %s}}
`, hash, list, list), 0o600))
}

// startFileBroker runs a broker authenticating against a password file.
func startFileBroker(t *testing.T, patterns ...string) (b *Broker, addr string, file *auth.FileAuthenticator, path string) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "users.yaml")
	aclFile(t, path, patterns...)
	fa, err := auth.NewFileAuthenticator(path, testutil.Logger(t))
	require.NoError(t, err)
	cfg := DefaultConfig()
	cfg.EdgeID = "test"
	b, err = New(cfg, fa, testutil.Logger(t), nil)
	require.NoError(t, err)
	addr = serveTCP(t, b)
	t.Cleanup(func() { _ = b.Close() })
	return b, addr, fa, path
}

// waitRefreshes waits until n ACL refreshes succeeded.
func waitRefreshes(t *testing.T, b *Broker, n float64) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, func() error {
		if got := promtest.ToFloat64(b.m.aclRefreshes.WithLabelValues("ok")); got < n {
			return fmt.Errorf("%v acl refreshes, want %v", got, n)
		}
		return nil
	})
}

func pendingACLs(b *Broker) int {
	b.aclw.mu.Lock()
	defer b.aclw.mu.Unlock()
	return len(b.aclw.pending)
}

// Only a higher version of a tenant starts a refresh. A cluster-wide bump
// (tenant "") applies to every tenant: a shared subscription no longer
// allowed is removed, and an MQTT 3.1.1 client publishing QoS 1 to a topic
// it may no longer use is disconnected (3.1.1 has no negative PUBACK).
func TestACLWatch_VersionsSharedAndV311(t *testing.T) {
	t.Parallel()
	b, addr, _, path := startFileBroker(t, "alerts/#", "devices/#")

	sub := mqtttest.Dial(t, addr, 5)
	require.Equal(t, byte(0), sub.ConnectAs("sub", "alice@acme", "pw", true, packets.Properties{}).ReasonCode)
	require.Equal(t, []byte{1}, sub.Subscribe(1, "$share/g/alerts/#", 1).ReasonCodes)
	require.Equal(t, []byte{1}, sub.Subscribe(2, "devices/#", 1).ReasonCodes)
	pub := mqtttest.Dial(t, addr, 4)
	pub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: "pub",
			UsernameFlag: true, Username: []byte("alice@acme"), PasswordFlag: true, Password: []byte("pw")}})
	require.Equal(t, byte(0), pub.Expect(packets.Connack).ReasonCode)
	pub.Publish(1, "alerts/a", 1, []byte("before"))
	pub.Expect(packets.Puback)
	got := sub.Expect(packets.Publish)
	require.Equal(t, "before", string(got.Payload))
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})

	b.ACLVersion("acme", 5)
	waitRefreshes(t, b, 1) // the first version seen counts: nothing changed, nothing revoked
	require.Zero(t, promtest.ToFloat64(b.m.aclRevoked))
	b.ACLVersion("acme", 5)
	b.ACLVersion("acme", 3)
	require.Zero(t, pendingACLs(b), "an old or repeated version starts no refresh")

	aclFile(t, path, "devices/#")
	b.ACLVersion("", 9)
	waitRefreshes(t, b, 2)
	require.Equal(t, 1.0, promtest.ToFloat64(b.m.aclRevoked), "the shared subscription went")

	require.NoError(t, b.Publish("acme", "alerts/b", []byte("gone"), 1, false))
	require.NoError(t, b.Publish("acme", "devices/d", []byte("kept"), 1, false))
	got = sub.Expect(packets.Publish)
	require.Equal(t, "kept", string(got.Payload), "nothing through the shared subscription")

	pub.Publish(2, "alerts/a", 1, []byte("forbidden"))
	for {
		pk, err := pub.Read(5 * time.Second)
		if err != nil {
			break // closed: refused without an acknowledgement
		}
		require.NotEqual(t, packets.Puback, pk.FixedHeader.Type, "the forbidden publish was acknowledged")
	}
	_, err := sub.Read(200 * time.Millisecond)
	require.Error(t, err, "the forbidden publish was not delivered")
}

// A persistent session resumed after its client's ACL changed keeps only
// the subscriptions the client may still make, even without a version bump
// (the file was reloaded while the client was away).
func TestACLWatch_ResumedSessionRechecked(t *testing.T) {
	t.Parallel()
	b, addr, fa, path := startFileBroker(t, "alerts/#", "devices/#")
	props := packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true}

	sub := mqtttest.Dial(t, addr, 5)
	require.False(t, sub.ConnectAs("sub", "alice@acme", "pw", false, props).SessionPresent)
	require.Equal(t, []byte{1}, sub.Subscribe(1, "alerts/#", 1).ReasonCodes)
	require.Equal(t, []byte{1}, sub.Subscribe(2, "devices/#", 1).ReasonCodes)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	testutil.Eventually(t, 5*time.Second, func() error {
		if s := b.session("4:acmesub"); s == nil || s.online.Load() {
			return fmt.Errorf("session not offline yet")
		}
		return nil
	})

	aclFile(t, path, "devices/#")
	require.NoError(t, fa.Reload())
	sub = mqtttest.Dial(t, addr, 5)
	require.True(t, sub.ConnectAs("sub", "alice@acme", "pw", false, props).SessionPresent)
	testutil.Eventually(t, 5*time.Second, func() error {
		if n := promtest.ToFloat64(b.m.aclRevoked); n != 1 {
			return fmt.Errorf("%v subscriptions revoked", n)
		}
		return nil
	})
	require.NoError(t, b.Publish("acme", "alerts/b", []byte("gone"), 1, false))
	require.NoError(t, b.Publish("acme", "devices/d", []byte("kept"), 1, false))
	got := sub.Expect(packets.Publish)
	require.Equal(t, "kept", string(got.Payload))
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	_, err := sub.Read(200 * time.Millisecond)
	require.Error(t, err)
}

// A resumed session whose subscriptions are rechecked while the router
// does not answer a route removal does not hold the CONNECT guard through
// it: a takeover of the session from another edge meanwhile (which takes
// the guards' lock, then the guard's) would hold up every CONNECT here.
func TestACLWatch_RecheckDoesNotHoldTheConnectGuard(t *testing.T) {
	t.Parallel()
	b, addr, fa, path := startFileBroker(t, "alerts/#", "devices/#")
	release := make(chan struct{})
	open := sync.OnceFunc(func() { close(release) })
	t.Cleanup(open)
	routes := &blockingRemove{countingRoutes: newCountingRoutes(func(string, int) (<-chan struct{}, error) { return nil, nil }),
		filter: "alerts/#", entered: make(chan struct{}, 1), release: release}
	b.SetCluster(Cluster{Routes: routes})
	props := packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true}

	sub := mqtttest.Dial(t, addr, 5)
	require.False(t, sub.ConnectAs("sub", "alice@acme", "pw", false, props).SessionPresent)
	require.Equal(t, []byte{1}, sub.Subscribe(1, "alerts/#", 1).ReasonCodes)
	sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	testutil.Eventually(t, 5*time.Second, func() error {
		if s := b.session("4:acmesub"); s == nil || s.online.Load() {
			return fmt.Errorf("session not offline yet")
		}
		return nil
	})
	aclFile(t, path, "devices/#")
	require.NoError(t, fa.Reload())
	sub = mqtttest.Dial(t, addr, 5)
	sub.ConnectAs("sub", "alice@acme", "pw", false, props)
	select {
	case <-routes.entered: // the recheck waits on the router
	case <-time.After(5 * time.Second):
		t.Fatal("the revoked subscription's route was not removed")
	}

	epoch := sessionEpoch(b, "4:acmesub")
	go func() { _, _, _, _ = b.TakeOver(context.Background(), "acme", "sub", "edge-other", epoch+1, false) }()
	time.Sleep(100 * time.Millisecond) // the takeover marks the CONNECTs in flight
	other := mqtttest.Dial(t, addr, 5)
	other.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: props,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Keepalive: 30, ClientIdentifier: "other",
			UsernameFlag: true, Username: []byte("alice@acme"), PasswordFlag: true, Password: []byte("pw")}})
	ack, err := other.Read(3 * time.Second)
	require.NoError(t, err, "another client's CONNECT is answered")
	require.Equal(t, packets.Connack, ack.FixedHeader.Type)
	require.Equal(t, byte(0), ack.ReasonCode)
}

// firstRemoveWaits is a route table whose first removal waits until
// release is closed, saying on entered which filter it removes.
type firstRemoveWaits struct {
	fakeRoutes
	once    sync.Once
	entered chan string
	release chan struct{}
}

func (r *firstRemoveWaits) Remove(ctx context.Context, tenant, filter, group string) error {
	first := false
	r.once.Do(func() { first = true })
	if first {
		r.entered <- filter
		<-r.release
	}
	return r.fakeRoutes.Remove(ctx, tenant, filter, group)
}

// An ACL change that revokes two subscriptions of a connection's session,
// whose first route removal waits on the router while a newer connection
// of the client, allowed both, takes the session over: the recheck made for
// the older connection leaves the newer one's subscriptions alone.
func TestACLWatch_RecheckLeavesANewerConnectionsSubscriptions(t *testing.T) {
	t.Parallel()
	b, addr, fa, path := startFileBroker(t, "alerts/#", "devices/#")
	routes := &firstRemoveWaits{fakeRoutes: fakeRoutes{add: func(string, string, string) error { return nil }},
		entered: make(chan string, 1), release: make(chan struct{})}
	open := sync.OnceFunc(func() { close(routes.release) })
	t.Cleanup(open)
	b.SetCluster(Cluster{Routes: routes})
	props := packets.Properties{SessionExpiryInterval: 300, SessionExpiryIntervalFlag: true}
	const id = "4:acmesub"

	sub := mqtttest.Dial(t, addr, 5)
	require.False(t, sub.ConnectAs("sub", "alice@acme", "pw", false, props).SessionPresent)
	require.Equal(t, []byte{1}, sub.Subscribe(1, "alerts/#", 1).ReasonCodes)
	require.Equal(t, []byte{1}, sub.Subscribe(2, "devices/#", 1).ReasonCodes)
	s := b.session(id)
	s.mu.Lock()
	older := s.client
	s.mu.Unlock()

	aclFile(t, path, "other/#")
	b.ACLVersion("acme", 1)
	var first string
	select {
	case first = <-routes.entered: // the recheck waits on the router
	case <-time.After(5 * time.Second):
		t.Fatal("no revoked subscription's route was removed")
	}
	kept := map[string]string{"alerts/#": "devices/d", "devices/#": "alerts/a"}[first]

	aclFile(t, path, "alerts/#", "devices/#")
	require.NoError(t, fa.Reload())
	newer := mqtttest.Dial(t, addr, 5)
	require.True(t, newer.ConnectAs("sub", "alice@acme", "pw", false, props).SessionPresent)
	require.Eventually(t, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.client != nil && s.client != older
	}, 5*time.Second, time.Millisecond, "the newer connection holds the session")
	open()
	waitRefreshes(t, b, 1)

	require.NoError(t, b.Publish("acme", kept, []byte("kept"), 1, false))
	got := newer.Expect(packets.Publish)
	require.Equal(t, kept, got.TopicName, "the newer connection's subscription stays")
	require.Equal(t, 1.0, promtest.ToFloat64(b.m.aclRevoked), "only the removal made before the takeover")
}
