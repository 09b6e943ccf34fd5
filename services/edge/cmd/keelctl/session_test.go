package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// Against a real coordinator, router node and edge, with real MQTT
// clients: session list shows the sessions the edge claimed, filtered and
// limited, in a table and as JSON; session kick finds the owner edge at the
// coordinator and disconnects the client there (DISCONNECT 0x98 for MQTT 5,
// the will published), keeping the session or, with --discard, ending it so
// that it leaves the listing.
func TestKeelctl_SessionListAndKick(t *testing.T) {
	bins := buildServices(t, "coordinator", "router", "edge")
	routerAPI, coordAPI := startCore(t, bins, "10s")
	if t.Failed() {
		return
	}
	coordURL := "http://" + coordAPI
	mqttAddr, edgeOps, edgeAPI := testutil.FreeAddr(t), testutil.FreeAddr(t), testutil.FreeAddr(t)
	startService(t, "edge", bins["edge"], edgeOps, "--auth.anonymous", "--mqtt.tcp-addr", mqttAddr, "--mqtt.ws-addr", "",
		"--ops.addr", edgeOps, "--data-dir", t.TempDir(), "--mqtt.edge-id", "edge-a", "--log.level", "warn",
		"--cluster.coordinator", coordURL, "--cluster.router", "http://"+routerAPI, "--cluster.api-addr", edgeAPI)
	if t.Failed() {
		return
	}
	ctx := t.Context()
	var out bytes.Buffer
	runOK := func(args ...string) string {
		t.Helper()
		out.Reset()
		require.NoError(t, run(ctx, args, &out, &out), "%v: %s", args, out.String())
		return out.String()
	}
	persistent := packets.Properties{SessionExpiryInterval: 3600, SessionExpiryIntervalFlag: true}
	dial := func(client string, v byte, clean bool) *mqtttest.Client {
		t.Helper()
		c := mqtttest.Dial(t, mqttAddr, v)
		props := packets.Properties{}
		if v == 5 && !clean {
			props = persistent
		}
		c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: props,
			Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: clean, Keepalive: 30, ClientIdentifier: client,
				WillFlag: true, WillTopic: "wills/" + client, WillPayload: []byte(client + " gone"), WillQos: 1}})
		require.Equal(t, byte(0), c.Expect(packets.Connack).ReasonCode)
		return c
	}
	watch := mqtttest.Dial(t, mqttAddr, 5)
	watch.Connect("watch", true, packets.Properties{})
	watch.Subscribe(1, "wills/#", 1)
	expectWill := func(client string) {
		t.Helper()
		got := watch.Expect(packets.Publish)
		require.Equal(t, "wills/"+client, got.TopicName)
		watch.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}
	expectKicked := func(c *mqtttest.Client, v byte) {
		t.Helper()
		pk, err := c.Read(5 * time.Second)
		if v == 5 {
			require.NoError(t, err)
			require.Equal(t, packets.Disconnect, pk.FixedHeader.Type)
			require.Equal(t, packets.ErrAdministrativeAction.Code, pk.ReasonCode)
			_, err = c.Read(5 * time.Second)
		}
		require.Error(t, err, "the connection closes")
		var ne interface{ Timeout() bool }
		require.False(t, errors.As(err, &ne) && ne.Timeout(), "closed, not just quiet: %v", err)
	}
	dev1 := dial("dev-1", 5, false)
	dev2 := dial("dev-2", 4, true)
	sensor := dial("sensor-9", 5, false)

	// session list
	table := runOK("session", "list", "--coordinator", coordURL)
	t.Logf("session list:\n%s", table)
	require.Regexp(t, `(?m)^TENANT\s+CLIENT ID\s+OWNER\s+INCARNATION\s+KIND\s+EPOCH\s+GRANTED$`, table)
	for _, id := range []string{"dev-1", "dev-2", "sensor-9", "watch"} {
		require.Regexp(t, `(?m)^default\s+`+id+`\s+edge-a\s+\d+\s+connection\s+\d+\s+\d{4}-`, table)
	}
	require.NotContains(t, table, "the listing goes on")
	var list struct {
		List struct {
			Sessions []struct {
				Session struct {
					Tenant   string `json:"tenant"`
					ClientID string `json:"client_id"`
				} `json:"session"`
				Epoch       string `json:"epoch"`
				OwnerEdgeID string `json:"owner_edge_id"`
				OwnerKind   string `json:"owner_kind"`
			} `json:"sessions"`
			NextPageToken string `json:"next_page_token"`
		} `json:"list"`
	}
	require.NoError(t, json.Unmarshal([]byte(runOK("session", "list", "--coordinator", coordURL, "--tenant", "default", "--prefix", "dev-", "-o", "json")), &list), out.String())
	require.Len(t, list.List.Sessions, 2)
	require.Equal(t, "dev-1", list.List.Sessions[0].Session.ClientID)
	require.Equal(t, "dev-2", list.List.Sessions[1].Session.ClientID)
	require.Equal(t, "edge-a", list.List.Sessions[0].OwnerEdgeID)
	require.Equal(t, "SESSION_OWNER_KIND_CONNECTION", list.List.Sessions[0].OwnerKind)
	require.NotEmpty(t, list.List.Sessions[0].Epoch)
	require.Empty(t, list.List.NextPageToken)

	table = runOK("session", "list", "--coordinator", coordURL, "--edge", "edge-a", "--limit", "2")
	require.Len(t, regexpRows(table, `^default\s`), 2)
	require.Contains(t, table, "(first 2 sessions; the listing goes on")
	list.List.NextPageToken = ""
	require.NoError(t, json.Unmarshal([]byte(runOK("session", "list", "--coordinator", coordURL, "--limit", "3", "-o", "json")), &list))
	require.Len(t, list.List.Sessions, 3)
	require.NotEmpty(t, list.List.NextPageToken, "more sessions follow")
	require.Contains(t, runOK("session", "list", "--coordinator", coordURL, "--edge", "edge-b"), "no sessions")
	require.Contains(t, runOK("session", "list", "--coordinator", coordURL, "--tenant", "acme"), "no sessions")
	t.Setenv("KEEL_EDGE", "http://"+edgeAPI) // an edge's URL: not an owner to filter by
	require.Len(t, regexpRows(runOK("session", "list", "--coordinator", coordURL), `^default\s`), 4)

	// session kick: MQTT 5, the session stays.
	table = runOK("session", "kick", "--coordinator", coordURL, "--tenant", "default", "dev-1")
	t.Logf("session kick:\n%s", table)
	require.Regexp(t, `^session default/dev-1 on edge edge-a \(epoch \d+\): client disconnected \(DISCONNECT 0x98, administrative action\); session kept\n$`, table)
	expectKicked(dev1, 5)
	expectWill("dev-1")
	require.Regexp(t, `(?m)^default\s+dev-1\s+edge-a\s`, runOK("session", "list", "--coordinator", coordURL))

	// Discarding the offline session ends it; it leaves the listing.
	var kick struct {
		Ownership struct {
			Session struct {
				OwnerEdgeID string `json:"owner_edge_id"`
			} `json:"session"`
		} `json:"ownership"`
		Kick struct {
			WasConnected    bool `json:"was_connected"`
			ProtocolVersion int  `json:"protocol_version"`
			Discarded       bool `json:"discarded"`
		} `json:"kick"`
	}
	require.NoError(t, json.Unmarshal([]byte(runOK("session", "kick", "--coordinator", coordURL, "--tenant", "default", "--discard", "-o", "json", "dev-1")), &kick), out.String())
	require.Equal(t, "edge-a", kick.Ownership.Session.OwnerEdgeID)
	require.False(t, kick.Kick.WasConnected)
	require.True(t, kick.Kick.Discarded)
	testutil.Eventually(t, 10*time.Second, func() error {
		if tab := runOK("session", "list", "--coordinator", coordURL, "--prefix", "dev-1"); !strings.Contains(tab, "no sessions") {
			return fmt.Errorf("dev-1 still listed:\n%s", tab)
		}
		return nil
	})

	// A connected client, discarded.
	table = runOK("session", "kick", "--coordinator", coordURL, "--tenant", "default", "--discard", "sensor-9")
	require.Contains(t, table, "DISCONNECT 0x98")
	require.Contains(t, table, "session ended")
	expectKicked(sensor, 5)
	expectWill("sensor-9")

	// MQTT 3.1.1: the connection is closed, and the clean session ends.
	kick.Kick = struct {
		WasConnected    bool `json:"was_connected"`
		ProtocolVersion int  `json:"protocol_version"`
		Discarded       bool `json:"discarded"`
	}{}
	require.NoError(t, json.Unmarshal([]byte(runOK("session", "kick", "--coordinator", coordURL, "--tenant", "default", "-o", "json", "dev-2")), &kick), out.String())
	require.True(t, kick.Kick.WasConnected)
	require.Equal(t, 4, kick.Kick.ProtocolVersion)
	require.True(t, kick.Kick.Discarded)
	expectKicked(dev2, 4)
	expectWill("dev-2")
	testutil.Eventually(t, 10*time.Second, func() error {
		if rows := regexpRows(runOK("session", "list", "--coordinator", coordURL), `^default\s`); len(rows) != 1 {
			return fmt.Errorf("want only watch left: %v", rows)
		}
		return nil
	})

	// --edge URL calls that edge instead of the owner's advertised address.
	table = runOK("session", "kick", "--coordinator", coordURL, "--tenant", "default", "--edge", "http://"+edgeAPI, "watch")
	require.Contains(t, table, "session default/watch on edge edge-a")
	expectKicked(watch, 5)

	// errors
	err := run(ctx, []string{"session", "kick", "--coordinator", coordURL, "--tenant", "default", "nobody"}, &out, &out)
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err), "%v", err)
	require.ErrorContains(t, err, "no owner at the coordinator")
	err = run(ctx, []string{"session", "list", "--coordinator", coordURL, "--prefix", strings.Repeat("x", 300)}, &out, &out)
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	require.ErrorContains(t, err, "client_id_prefix is 300 bytes")
	for _, args := range [][]string{
		{"session", "list", "--coordinator", coordURL, "extra"},
		{"session", "list", "--coordinator", coordURL, "--limit", "-1"},
		{"session", "list", "--coordinator", coordURL, "--tenant", "Bad Tenant"},
		{"session", "kick", "--coordinator", coordURL, "dev-1"},
		{"session", "kick", "--coordinator", coordURL, "--tenant", "default"},
		{"session", "kick", "--coordinator", coordURL, "--tenant", "default", "a", "b"},
	} {
		err := run(ctx, args, &out, &out)
		require.Error(t, err, "%v", args)
		t.Logf("%v: %v", args, err)
	}
	t.Setenv("KEEL_COORDINATOR", "")
	require.ErrorContains(t, run(ctx, []string{"session", "list"}, &out, &out), "give --coordinator")
	require.ErrorContains(t, run(ctx, []string{"session", "kick", "--tenant", "default", "watch"}, &out, &out), "give --coordinator")
}

// regexpRows returns the lines of table that match pattern.
func regexpRows(table, pattern string) []string {
	var rows []string
	for _, line := range strings.Split(table, "\n") {
		if ok, _ := regexp.MatchString(pattern, line); ok {
			rows = append(rows, line)
		}
	}
	return rows
}
