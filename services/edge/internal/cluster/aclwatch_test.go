package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/listener"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// TestACLWatch_BumpAppliesToConnectedClients runs a real coordinator and an
// edge broker following its cluster watch, with users in a password file
// that keelctl edits. After keelctl narrows a user's ACL and bumps the
// tenant's ACL version at the coordinator, a connected client's publish to a
// topic it may no longer use is refused (PUBACK 0x87) and not delivered, and
// its subscriptions that are no longer allowed stop receiving, while the
// allowed ones go on. After keelctl removes the user (and bumps), its
// clients are disconnected with 0x87 and it cannot connect again.
func TestACLWatch_BumpAppliesToConnectedClients(t *testing.T) {
	t.Parallel()
	coordURL, _ := startCoordinator(t, 10*time.Second)
	dir := t.TempDir()
	keelctl := testutil.Build(t, dir, "./services/edge/cmd/keelctl")
	users := filepath.Join(dir, "users.yaml")
	ctl := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(keelctl, args...)
		cmd.Env = append(os.Environ(), "KEEL_PASSWORD=pw")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "keelctl %v: %s", args, out)
		return string(out)
	}
	ctl("users", "add", "--file", users, "--publish", "devices/%u/#,alerts/#", "--subscribe", "devices/%u/#,alerts/#", "acme", "alice")

	logger := testutil.Logger(t)
	fa, err := auth.NewFileAuthenticator(users, logger)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	cfg := broker.DefaultConfig()
	cfg.EdgeID = "edge-acl"
	b, err := broker.New(cfg, fa, logger, reg)
	require.NoError(t, err)
	l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
	require.NoError(t, b.AddListener(l))
	require.NoError(t, b.Serve())
	t.Cleanup(func() { _ = b.Close() })
	w := &Watch{Client: NewClient(coordURL), Self: "edge-acl", Incarnation: func() uint64 { return 1 }, ACL: b, Logger: logger}
	go func() { _ = w.Run(t.Context()) }()

	sub := mqtttest.Dial(t, l.Address(), 5)
	require.Equal(t, byte(0), sub.ConnectAs("sub", "alice@acme", "pw", true, packets.Properties{}).ReasonCode)
	require.Equal(t, []byte{1}, sub.Subscribe(1, "alerts/#", 1).ReasonCodes)
	require.Equal(t, []byte{1}, sub.Subscribe(2, "devices/alice/#", 1).ReasonCodes)
	pub := mqtttest.Dial(t, l.Address(), 5)
	require.Equal(t, byte(0), pub.ConnectAs("pub", "alice@acme", "pw", true, packets.Properties{}).ReasonCode)

	expectMsg := func(topic, payload string) {
		t.Helper()
		got := sub.Expect(packets.Publish)
		require.Equal(t, topic, got.TopicName)
		require.Equal(t, payload, string(got.Payload))
		sub.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
	pub.Publish(1, "alerts/a", 1, []byte("before"))
	require.Equal(t, byte(0), pub.Expect(packets.Puback).ReasonCode)
	expectMsg("alerts/a", "before")

	refreshed := testutil.CounterValue(t, reg, "keel_edge_acl_refreshes_total", map[string]string{"outcome": "ok"})
	out := ctl("users", "add", "--file", users, "--coordinator", coordURL, "--publish", "devices/%u/#", "--subscribe", "devices/%u/#", "acme", "alice")
	require.Contains(t, out, "acl version of tenant acme is now")
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := testutil.CounterValue(t, reg, "keel_edge_acl_refreshes_total", map[string]string{"outcome": "ok"}); n <= refreshed {
			return fmt.Errorf("no acl refresh yet (%v)", n)
		}
		return nil
	})
	require.Equal(t, 1.0, testutil.CounterValue(t, reg, "keel_edge_acl_revoked_subscriptions_total", nil), "alerts/# revoked, devices/alice/# kept")

	// The cached decision for alerts/a went with the old rules.
	pub.Publish(2, "alerts/a", 1, []byte("forbidden"))
	require.Equal(t, packets.ErrNotAuthorized.Code, pub.Expect(packets.Puback).ReasonCode)
	pub.Publish(3, "devices/alice/x", 1, []byte("allowed"))
	require.Equal(t, byte(0), pub.Expect(packets.Puback).ReasonCode)
	// Published by the edge itself, so no client ACL applies: only the
	// revoked subscription keeps it from the subscriber.
	require.NoError(t, b.Publish("acme", "alerts/b", []byte("not for sub"), 1, false))
	require.NoError(t, b.Publish("acme", "devices/alice/y", []byte("for sub"), 1, false))
	expectMsg("devices/alice/x", "allowed")
	expectMsg("devices/alice/y", "for sub")
	_, err = sub.Read(300 * time.Millisecond)
	require.Error(t, err, "nothing on the revoked subscription")
	require.Equal(t, []byte{packets.ErrNotAuthorized.Code}, sub.Subscribe(3, "alerts/#", 1).ReasonCodes)

	// Removing the user disconnects its clients.
	ctl("users", "remove", "--file", users, "--coordinator", coordURL, "acme", "alice")
	require.Equal(t, packets.ErrNotAuthorized.Code, sub.Expect(packets.Disconnect).ReasonCode)
	require.Equal(t, packets.ErrNotAuthorized.Code, pub.Expect(packets.Disconnect).ReasonCode)
	again := mqtttest.Dial(t, l.Address(), 5)
	require.Equal(t, packets.ErrBadUsernameOrPassword.Code, again.ConnectAs("again", "alice@acme", "pw", true, packets.Properties{}).ReasonCode)
}
