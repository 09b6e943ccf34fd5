package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// Against a real edge process (with a real coordinator and router): edge
// status shows the edge ready with its lease, client, session and route;
// edge drain --wait drains it, the MQTT 5 client getting DISCONNECT 0x9C
// with the server reference the edge was given (--cluster.server-reference),
// and polls until drained; a drained edge reports so (table and JSON),
// is not ready, and stops promptly on SIGTERM without draining again.
func TestKeelctl_EdgeStatusAndDrain(t *testing.T) {
	bins := buildServices(t, "coordinator", "router", "edge")
	began := time.Now()
	routerAPI, coordAPI := startCore(t, bins, "10s")
	if t.Failed() {
		return
	}
	const ref = "mqtt.example:1883"
	mqttAddr, edgeOps, edgeAPI := testutil.FreeAddr(t), testutil.FreeAddr(t), testutil.FreeAddr(t)
	edge := startService(t, "edge", bins["edge"], edgeOps, "--auth.anonymous", "--mqtt.tcp-addr", mqttAddr, "--mqtt.ws-addr", "",
		"--ops.addr", edgeOps, "--data-dir", t.TempDir(), "--mqtt.edge-id", "edge-a", "--log.level", "info", "--stop-timeout", "5s",
		"--cluster.coordinator", "http://"+coordAPI, "--cluster.router", "http://"+routerAPI, "--cluster.api-addr", edgeAPI,
		"--cluster.server-reference", ref)
	if t.Failed() {
		return
	}
	t.Logf("services up in %v", time.Since(began).Round(time.Millisecond))
	edgeURL := "http://" + edgeAPI
	ctx := t.Context()
	var out bytes.Buffer
	runOK := func(args ...string) string {
		t.Helper()
		out.Reset()
		require.NoError(t, run(ctx, args, &out, &out), "%v: %s", args, out.String())
		return out.String()
	}
	type edgeStatusJSON struct {
		Edge struct {
			EdgeID         string `json:"edge_id"`
			Incarnation    string `json:"incarnation"`
			State          string `json:"state"`
			LeaseRemaining string `json:"lease_remaining"`
			Connections    int    `json:"connections"`
			SessionsOwned  int    `json:"sessions_owned"`
			Routes         int    `json:"routes"`
		} `json:"edge"`
	}
	statusJSON := func() edgeStatusJSON {
		t.Helper()
		var st edgeStatusJSON
		require.NoError(t, json.Unmarshal([]byte(runOK("edge", "status", "--edge", edgeURL, "-o", "json")), &st), out.String())
		return st
	}

	// A client with a subscription.
	dev := mqtttest.Dial(t, mqttAddr, 5)
	require.Equal(t, packets.CodeSuccess.Code, dev.Connect("dev", true, packets.Properties{}).ReasonCode)
	require.Equal(t, []byte{1}, dev.Subscribe(1, "t/#", 1).ReasonCodes)

	table := runOK("edge", "status", "--edge", edgeURL)
	t.Logf("edge status:\n%s", table)
	require.Regexp(t, `(?m)^EDGE\s+INCARNATION\s+STATE\s+LEASE LEFT\s+CONNECTIONS\s+SESSIONS\s+IN CUSTODY\s+ROUTES$`, table)
	require.Regexp(t, `(?m)^edge-a\s+[1-9][0-9]*\s+ready\s+[0-9.]+m?s\s+1\s+1\s+0\s+1$`, table)
	st := statusJSON()
	require.Equal(t, "edge-a", st.Edge.EdgeID)
	require.Equal(t, "EDGE_STATE_READY", st.Edge.State)
	require.NotEmpty(t, st.Edge.Incarnation)
	left, err := time.ParseDuration(st.Edge.LeaseRemaining)
	require.NoError(t, err, st.Edge.LeaseRemaining)
	require.Greater(t, left, time.Duration(0))
	require.LessOrEqual(t, left, 10*time.Second)
	require.Equal(t, 1, st.Edge.Connections)
	require.Equal(t, 1, st.Edge.SessionsOwned)
	require.Equal(t, 1, st.Edge.Routes)

	// edge drain --wait: rows until drained.
	table = runOK("edge", "drain", "--edge", edgeURL, "--wait", "--deadline", "20s")
	t.Logf("edge drain --wait:\n%s", table)
	require.Regexp(t, `^STATE\s+CONNECTIONS LEFT\s+SESSIONS LEFT\n`, table)
	require.Regexp(t, `(?m)^drained\s+0\s+0\n\z`, table)
	got := closedWith(t, dev)
	require.Len(t, got, 1, "one DISCONNECT, then the connection closes")
	require.Equal(t, packets.ErrUseAnotherServer.Code, got[0].ReasonCode)
	require.Equal(t, ref, got[0].Properties.ServerReference)

	var drain struct {
		Drain struct {
			State                string `json:"state"`
			ConnectionsRemaining int    `json:"connections_remaining"`
		} `json:"drain"`
	}
	require.NoError(t, json.Unmarshal([]byte(runOK("edge", "drain", "--edge", edgeURL, "-o", "json")), &drain), out.String())
	require.Equal(t, "EDGE_STATE_DRAINED", drain.Drain.State)
	require.Zero(t, drain.Drain.ConnectionsRemaining)
	require.Regexp(t, `(?m)^edge-a\s+[1-9][0-9]*\s+drained\s+[0-9.]+m?s\s+0\s+0\s+0\s+0$`, runOK("edge", "status", "--edge", edgeURL))
	require.Equal(t, "EDGE_STATE_DRAINED", statusJSON().Edge.State)
	resp, err := http.Get("http://" + edgeOps + "/readyz")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "a drained edge is not ready")
	late := mqtttest.Dial(t, mqttAddr, 5)
	require.Equal(t, packets.ErrServerUnavailable.Code, late.Connect("late", true, packets.Properties{}).ReasonCode)

	// SIGTERM: the drained edge stops at once, without a second drain.
	stopping := time.Now()
	require.True(t, edge.stop(10*time.Second), "drained edge did not stop within 10s of SIGTERM")
	t.Logf("drained edge stopped in %v", time.Since(stopping).Round(time.Millisecond))
	require.NoError(t, edge.err)
	logs := edge.logs.String()
	require.Contains(t, logs, "no second drain")
	require.Equal(t, 1, strings.Count(logs, `"msg":"draining`), "one drain")
}

// closedWith reads what is left on c: the packets before the connection
// closed.
func closedWith(t *testing.T, c *mqtttest.Client) []packets.Packet {
	t.Helper()
	var got []packets.Packet
	for {
		pk, err := c.Read(5 * time.Second)
		if err != nil {
			var ne net.Error
			require.False(t, errors.As(err, &ne) && ne.Timeout(), "connection still open")
			return got
		}
		got = append(got, pk)
	}
}
