package app

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/prometheus/client_golang/prometheus"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/rpc"
	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/forward"
	"github.com/keelmq/keel/services/edge/internal/listener"
	"github.com/keelmq/keel/services/edge/internal/mqtttest"
	"github.com/keelmq/keel/services/edge/internal/tenancy"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/proto/gen/keel/edge/v1/edgev1connect"
)

// kickEdge is a broker with a durable store on a loopback port, and its
// edge API served over h2c as the edge serves it.
type kickEdge struct {
	mqtt  string
	api   edgev1connect.EdgeServiceClient
	store *durable.Store
	kicks *prometheus.CounterVec
	reg   *prometheus.Registry
}

func startKickEdge(t *testing.T) *kickEdge {
	t.Helper()
	cfg := broker.DefaultConfig()
	cfg.EdgeID = "edge-k"
	reg := prometheus.NewRegistry()
	b, err := broker.New(cfg, auth.Anonymous{Tenant: "default"}, testutil.Logger(t), reg)
	require.NoError(t, err)
	st, err := durable.Open(t.TempDir(), testutil.Logger(t))
	require.NoError(t, err)
	require.NoError(t, b.Restore(st))
	l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
	require.NoError(t, b.AddListener(l))
	require.NoError(t, b.Serve())
	t.Cleanup(func() { _ = b.Close(); _ = st.Close() })

	api := &edgeAPI{Server: &forward.Server{Deliver: b, Sessions: b, Custodian: b}, Kicker: b, Kicks: kickCounter(reg)}
	require.Same(t, api.Kicks, kickCounter(reg), "registered once")
	mux := http.NewServeMux()
	mux.Handle(api.Handler())
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = rpc.ServerProtocols()
	srv.Config.HTTP2 = rpc.ServerHTTP2()
	srv.Start()
	t.Cleanup(srv.Close)
	return &kickEdge{mqtt: l.Address(), store: st, kicks: api.Kicks, reg: reg,
		api: edgev1connect.NewEdgeServiceClient(rpc.H2CClient(), srv.URL, rpc.ClientOptions()...)}
}

func (e *kickEdge) kick(t *testing.T, client string, discard bool) (*edgev1.KickSessionResponse, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	resp, err := e.api.KickSession(ctx, connect.NewRequest(&edgev1.KickSessionRequest{
		Session: &commonv1.SessionKey{Tenant: "default", ClientId: client}, Discard: discard}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// connections returns the edge's keel_edge_connections.
func (e *kickEdge) connections(t *testing.T) int {
	t.Helper()
	mfs, err := e.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "keel_edge_connections" {
			return int(mf.GetMetric()[0].GetGauge().GetValue())
		}
	}
	t.Fatal("no keel_edge_connections")
	return 0
}

// stored reports whether the edge's store holds the session of client.
func (e *kickEdge) stored(t *testing.T, client string) bool {
	t.Helper()
	sc, err := tenancy.NewScope("default")
	require.NoError(t, err)
	_, ok, err := e.store.LoadSession(t.Context(), sc.ClientID(client))
	require.NoError(t, err)
	return ok
}

var persistent = packets.Properties{SessionExpiryInterval: 3600, SessionExpiryIntervalFlag: true}

// connectWithWill connects client (MQTT version v) with a will on
// wills/<client> (payload "<client> gone") of delay willDelay (MQTT 5),
// and a persistent session unless clean.
func connectWithWill(t *testing.T, addr string, v byte, client string, clean bool, willDelay uint32) (*mqtttest.Client, packets.Packet) {
	t.Helper()
	c := mqtttest.Dial(t, addr, v)
	props := packets.Properties{}
	if v == 5 && !clean {
		props = persistent
	}
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Properties: props,
		Connect: packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: clean, Keepalive: 30, ClientIdentifier: client,
			WillFlag: true, WillTopic: "wills/" + client, WillPayload: []byte(client + " gone"), WillQos: 1,
			WillProperties: packets.Properties{WillDelayInterval: willDelay}}})
	return c, c.Expect(packets.Connack)
}

// expectClosed reads what is left on c: the packets before the connection
// closed.
func expectClosed(t *testing.T, c *mqtttest.Client) []packets.Packet {
	t.Helper()
	var got []packets.Packet
	for {
		pk, err := c.Read(5 * time.Second)
		if err != nil {
			var ne interface{ Timeout() bool }
			require.False(t, errors.As(err, &ne) && ne.Timeout(), "connection still open")
			return got
		}
		got = append(got, pk)
	}
}

// KickSession disconnects a real MQTT 5 client with DISCONNECT 0x98 and
// publishes its will; the persistent session stays (a reconnect resumes it,
// with what was queued meanwhile) unless discard ends it, which removes it
// from the store as well. An MQTT 3.1.1 client's connection is closed
// without a DISCONNECT. A session this edge does not hold is NotFound.
func TestEdgeAPI_KickSession(t *testing.T) {
	t.Parallel()
	e := startKickEdge(t)
	watch := mqtttest.Dial(t, e.mqtt, 5)
	watch.Connect("watch", true, packets.Properties{})
	watch.Subscribe(1, "wills/#", 1)
	pub := mqtttest.Dial(t, e.mqtt, 4)
	pub.Connect("pub", true, packets.Properties{})
	publish := func(id uint16, topic string) {
		t.Helper()
		pub.Publish(id, topic, 1, []byte(topic))
		require.Equal(t, id, pub.Expect(packets.Puback).PacketID)
	}
	expectWill := func(client string) {
		t.Helper()
		got := watch.Expect(packets.Publish)
		require.Equal(t, "wills/"+client, got.TopicName)
		require.Equal(t, []byte(client+" gone"), got.Payload)
		watch.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: got.PacketID})
	}

	// Kick without discard: DISCONNECT 0x98, will out, session kept.
	dev, ack := connectWithWill(t, e.mqtt, 5, "dev", false, 0)
	require.False(t, ack.SessionPresent)
	dev.Subscribe(1, "q/#", 1)
	resp, err := e.kick(t, "dev", false)
	require.NoError(t, err)
	require.True(t, resp.GetWasConnected())
	require.Equal(t, uint32(5), resp.GetProtocolVersion())
	require.False(t, resp.GetDiscarded())
	got := expectClosed(t, dev)
	require.Len(t, got, 1, "one DISCONNECT, then the connection closes")
	require.Equal(t, packets.Disconnect, got[0].FixedHeader.Type)
	require.Equal(t, packets.ErrAdministrativeAction.Code, got[0].ReasonCode)
	expectWill("dev")
	require.True(t, e.stored(t, "dev"))
	publish(1, "q/while-away")
	dev, ack = connectWithWill(t, e.mqtt, 5, "dev", false, 0)
	require.True(t, ack.SessionPresent, "the session was kept")
	m := dev.Expect(packets.Publish)
	require.Equal(t, "q/while-away", m.TopicName, "queued while the client was away")
	dev.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: m.PacketID})

	// Kick with discard: the session ends, here and in the store.
	resp, err = e.kick(t, "dev", true)
	require.NoError(t, err)
	require.True(t, resp.GetWasConnected())
	require.True(t, resp.GetDiscarded())
	got = expectClosed(t, dev)
	require.Len(t, got, 1)
	require.Equal(t, packets.ErrAdministrativeAction.Code, got[0].ReasonCode)
	expectWill("dev")
	testutil.Eventually(t, 5*time.Second, func() error {
		if e.stored(t, "dev") {
			return errors.New("session still stored")
		}
		return nil
	})
	_, err = e.kick(t, "dev", false)
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err), "%v", err)
	dev = mqtttest.Dial(t, e.mqtt, 5)
	require.False(t, dev.Connect("dev", false, persistent).SessionPresent, "a fresh session")
	publish(2, "q/after-discard")
	_, err = dev.Read(300 * time.Millisecond)
	require.Error(t, err, "the discarded session's subscription went with it")
	_ = dev.Conn.Close()

	// An offline persistent session: kick alone does nothing, with discard
	// it ends.
	off := mqtttest.Dial(t, e.mqtt, 5)
	off.Connect("off", false, persistent)
	off.Subscribe(1, "q/#", 1)
	off.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}})
	expectClosed(t, off)
	testutil.Eventually(t, 5*time.Second, func() error {
		if n := e.connections(t); n != 2 {
			return fmt.Errorf("%d connections, want 2 (watch, pub)", n)
		}
		return nil
	})
	resp, err = e.kick(t, "off", false)
	require.NoError(t, err)
	require.False(t, resp.GetWasConnected())
	require.False(t, resp.GetDiscarded())
	require.True(t, e.stored(t, "off"))
	resp, err = e.kick(t, "off", true)
	require.NoError(t, err)
	require.False(t, resp.GetWasConnected())
	require.True(t, resp.GetDiscarded())
	off = mqtttest.Dial(t, e.mqtt, 5)
	require.False(t, off.Connect("off", false, persistent).SessionPresent)

	// MQTT 3.1.1: the connection just closes; the will goes out, and the
	// clean session ends with its connection.
	v3, _ := connectWithWill(t, e.mqtt, 4, "v3", true, 0)
	resp, err = e.kick(t, "v3", false)
	require.NoError(t, err)
	require.True(t, resp.GetWasConnected())
	require.Equal(t, uint32(4), resp.GetProtocolVersion())
	require.True(t, resp.GetDiscarded(), "a clean session ends with its connection")
	require.Empty(t, expectClosed(t, v3), "no DISCONNECT to an MQTT 3 client")
	expectWill("v3")

	// Refusals.
	_, err = e.kick(t, "nobody", false)
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err))
	require.ErrorContains(t, err, "edge edge-k")
	for _, k := range []*commonv1.SessionKey{nil, {Tenant: "default"}, {ClientId: "dev"}, {Tenant: "Bad Tenant", ClientId: "dev"}} {
		_, err = e.api.KickSession(t.Context(), connect.NewRequest(&edgev1.KickSessionRequest{Session: k}))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v: %v", k, err)
	}

	require.Equal(t, 1.0, promtest.ToFloat64(e.kicks.WithLabelValues("disconnected")))
	require.Equal(t, 2.0, promtest.ToFloat64(e.kicks.WithLabelValues("disconnected_ended")), "dev with discard, v3's clean session")
	require.Equal(t, 1.0, promtest.ToFloat64(e.kicks.WithLabelValues("ended")))
	require.Equal(t, 1.0, promtest.ToFloat64(e.kicks.WithLabelValues("offline")))
	require.Equal(t, 2.0, promtest.ToFloat64(e.kicks.WithLabelValues("not_found")))
}
