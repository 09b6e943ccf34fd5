package server

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sort"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
	"github.com/keelmq/keel/services/persistence/internal/store/boltstore"
	"github.com/keelmq/keel/services/persistence/internal/store/redisstore"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/proto/gen/keel/persistence/v1/persistencev1connect"
)

type testServer struct {
	url    string
	client persistencev1connect.PersistenceServiceClient
	grpc   persistencev1connect.PersistenceServiceClient
	srv    *Server
	http   *http.Server
}

func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}}
}

// startServer serves st on a loopback port (HTTP/1.1 and h2c) and returns
// a Connect and a gRPC client.
func startServer(t testing.TB, st store.Store) *testServer {
	t.Helper()
	return startServerWith(t, st, Config{})
}

func startServerWith(t testing.TB, st store.Store, cfg Config) *testServer {
	t.Helper()
	return serveTest(t, New(cfg, st, nil, nil, testutil.Logger(t)))
}

// serveTest serves srv's API over h2c, as the service does, until t ends.
func serveTest(t testing.TB, srv *Server) *testServer {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(srv.Handler())
	hs := httptest.NewUnstartedServer(mux)
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	hs.Config.Protocols = &p
	hs.Start()
	t.Cleanup(hs.Close)
	return &testServer{url: hs.URL, client: persistencev1connect.NewPersistenceServiceClient(h2cClient(), hs.URL),
		grpc: persistencev1connect.NewPersistenceServiceClient(h2cClient(), hs.URL, connect.WithGRPC()), srv: srv, http: hs.Config}
}

func boltStore(t *testing.T) store.Store {
	s, err := boltstore.Open(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

var sess = &commonv1.SessionKey{Tenant: "acme", ClientId: "dev-1"}

func fence(e uint64) *persistencev1.Fence { return &persistencev1.Fence{Epoch: e} }

func mid(seq uint64) *commonv1.MsgID {
	return &commonv1.MsgID{EdgeId: "edge/a", Incarnation: 7, Seq: seq}
}

func pmsg(seq uint64) *commonv1.Message {
	exp := uint32(3600)
	return &commonv1.Message{Id: mid(seq), Tenant: "acme", Topic: "a/b", Payload: []byte(fmt.Sprint(seq)), Qos: 1,
		IngressUnixNano: time.Now().UnixNano(), ClientId: "pub", ContentType: "text/plain",
		UserProperties: []*commonv1.UserProperty{{Key: "k", Value: "v"}}, MessageExpiryInterval: &exp}
}

func appendOp(e uint64, seqs ...uint64) *persistencev1.WriteOp {
	a := &persistencev1.AppendOp{}
	for _, s := range seqs {
		a.Entries = append(a.Entries, &persistencev1.Entry{MsgId: mid(s), Qos: 1})
		a.Messages = append(a.Messages, pmsg(s))
	}
	return &persistencev1.WriteOp{Session: sess, Fence: fence(e), Op: &persistencev1.WriteOp_Append{Append: a}}
}

func activate(e uint64) *persistencev1.WriteOp {
	return &persistencev1.WriteOp{Session: sess, Fence: fence(e), Op: &persistencev1.WriteOp_Activate{Activate: &persistencev1.ActivateOp{}}}
}

// writer is one Write stream.
type writer struct {
	t      *testing.T
	stream *connect.BidiStreamForClient[persistencev1.WriteRequest, persistencev1.WriteResponse]
	next   uint64
}

func newWriter(t *testing.T, c persistencev1connect.PersistenceServiceClient) *writer {
	st := c.Write(t.Context())
	t.Cleanup(func() { _ = st.CloseRequest(); _ = st.CloseResponse() })
	return &writer{t: t, stream: st}
}

// write sends one batch and returns its answer.
func (w *writer) write(ops ...*persistencev1.WriteOp) *persistencev1.WriteResponse {
	w.t.Helper()
	w.next++
	require.NoError(w.t, w.stream.Send(&persistencev1.WriteRequest{BatchId: w.next, Ops: ops}))
	resp, err := w.stream.Receive()
	require.NoError(w.t, err)
	require.Equal(w.t, w.next, resp.GetBatchId())
	return resp
}

func load(t *testing.T, c persistencev1connect.PersistenceServiceClient) *persistencev1.LoadSessionResponse {
	t.Helper()
	resp, err := c.LoadSession(t.Context(), connect.NewRequest(&persistencev1.LoadSessionRequest{Session: sess}))
	require.NoError(t, err)
	return resp.Msg
}

func TestServer_Write_RoundTrip(t *testing.T) {
	t.Parallel()
	ts := startServer(t, boltStore(t))
	for name, c := range map[string]persistencev1connect.PersistenceServiceClient{"connect": ts.client, "grpc": ts.grpc} {
		t.Run(name, func(t *testing.T) {
			w := newWriter(t, c)
			resp := w.write(activate(3),
				&persistencev1.WriteOp{Session: sess, Fence: fence(3), Op: &persistencev1.WriteOp_PutSession{PutSession: &persistencev1.PutSessionOp{
					Session: &persistencev1.Session{ProtocolVersion: 5, SessionExpiryInterval: 60, Will: &persistencev1.Will{Message: pmsg(99), DelayInterval: 5}}}}},
				&persistencev1.WriteOp{Session: sess, Fence: fence(3), Op: &persistencev1.WriteOp_PutSubscription{PutSubscription: &persistencev1.PutSubscriptionOp{
					Subscription: &persistencev1.Subscription{Filter: "$share/g/a/#", Qos: 2, SubscriptionIdentifier: 9}}}},
				appendOp(3, 1, 2, 3),
				&persistencev1.WriteOp{Session: sess, Fence: fence(3), Op: &persistencev1.WriteOp_Send{Send: &persistencev1.SendOp{
					Entries: []*persistencev1.Entry{{MsgId: mid(1), Qos: 1, PacketId: 10}}}}},
				&persistencev1.WriteOp{Session: sess, Fence: fence(3), Op: &persistencev1.WriteOp_PutIncoming{PutIncoming: &persistencev1.PutIncomingOp{
					Incoming: &persistencev1.Incoming{PacketId: 4, MsgId: mid(50)}}}},
				&persistencev1.WriteOp{Session: sess, Fence: fence(3), Op: &persistencev1.WriteOp_PutIncoming{PutIncoming: &persistencev1.PutIncomingOp{
					Incoming: &persistencev1.Incoming{PacketId: 5, MsgId: mid(51), Unconfirmed: true, Fingerprint: 0xfeedface}}}},
			)
			require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
			require.Len(t, resp.GetResults(), 7)
			require.Equal(t, uint32(3), resp.GetResults()[3].GetAdded())
			// A retry is idempotent.
			resp = w.write(appendOp(3, 2, 3))
			require.Equal(t, uint32(2), resp.GetResults()[0].GetDuplicates())

			st := load(t, c)
			require.Equal(t, uint64(3), st.GetEpoch())
			require.Equal(t, uint32(60), st.GetSession().GetSessionExpiryInterval())
			require.Equal(t, "a/b", st.GetSession().GetWill().GetMessage().GetTopic())
			require.Equal(t, "$share/g/a/#", st.GetSubscriptions()[0].GetFilter())
			require.Len(t, st.GetQueue(), 2)
			require.True(t, proto.Equal(mid(2), st.GetQueue()[0].GetMsgId()), "queue in order")
			require.Len(t, st.GetInflight(), 1)
			require.Equal(t, uint32(10), st.GetInflight()[0].GetPacketId())
			require.Len(t, st.GetIncoming(), 2)
			in := st.GetIncoming()
			sort.Slice(in, func(i, j int) bool { return in[i].GetPacketId() < in[j].GetPacketId() })
			require.True(t, proto.Equal(&persistencev1.Incoming{PacketId: 4, MsgId: mid(50)}, in[0]))
			require.True(t, proto.Equal(&persistencev1.Incoming{PacketId: 5, MsgId: mid(51), Unconfirmed: true, Fingerprint: 0xfeedface}, in[1]),
				"an unconfirmed record keeps its msgID and fingerprint: %v", in[1])
			require.Len(t, st.GetMessages(), 3)
			m := st.GetMessages()[0]
			require.True(t, proto.Equal(mid(2), m.GetId()))
			require.Equal(t, "text/plain", m.GetContentType())
			require.Equal(t, uint32(3600), m.GetMessageExpiryInterval())
			require.Equal(t, "v", m.GetUserProperties()[0].GetValue())

			// Clean up for the next client.
			resp = w.write(&persistencev1.WriteOp{Session: sess, Fence: fence(3), Op: &persistencev1.WriteOp_DeleteSession{DeleteSession: &persistencev1.DeleteSessionOp{}}})
			require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
		})
	}
}

// Stopping ends the open Write streams once their batches are answered
// (UNAVAILABLE: the client writes elsewhere), so the HTTP server's shutdown
// does not wait for the edges to close them.
func TestServer_StopEndsWriteStreams(t *testing.T) {
	t.Parallel()
	ts := startServer(t, boltStore(t))
	w := newWriter(t, ts.client)
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, w.write(activate(1)).GetStatus())
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	require.NoError(t, ts.srv.Stop(ctx))
	ended := make(chan error, 1)
	go func() { _, err := w.stream.Receive(); ended <- err }()
	select {
	case err := <-ended:
		require.Equal(t, connect.CodeUnavailable, connect.CodeOf(err), "%v", err)
	case <-ctx.Done():
		t.Fatal("the stream was not ended")
	}
	require.NoError(t, ts.http.Shutdown(ctx), "no stream holds the server open")
}

func TestServer_Write_Fenced(t *testing.T) {
	t.Parallel()
	ts := startServer(t, boltStore(t))
	w := newWriter(t, ts.client)
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, w.write(activate(5)).GetStatus())
	resp := w.write(appendOp(4, 1), appendOp(5, 2))
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_FENCED, resp.GetStatus())
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_FENCED, resp.GetResults()[0].GetStatus())
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetResults()[1].GetStatus(), "other ops of the batch stand")
	st := load(t, ts.client)
	require.Len(t, st.GetQueue(), 1)
	require.True(t, proto.Equal(mid(2), st.GetQueue()[0].GetMsgId()))
}

// badOps are malformed ops; each must be refused with nothing stored.
func badOps() map[string]*persistencev1.WriteOp {
	big := pmsg(1)
	big.Payload = make([]byte, DefaultLimits.MaxPayload+1)
	wild := pmsg(1)
	wild.Topic = "a/+"
	other := pmsg(1)
	other.Tenant = "evil"
	withMsg := func(m *commonv1.Message) *persistencev1.WriteOp {
		op := appendOp(1, 1)
		op.GetAppend().Messages[0] = m
		return op
	}
	mismatch := appendOp(1, 1)
	mismatch.GetAppend().Entries[0].MsgId = mid(2)
	noSession := appendOp(1, 1)
	noSession.Session = nil
	badTenant := appendOp(1, 1)
	badTenant.Session = &commonv1.SessionKey{Tenant: "Acme:x", ClientId: "c"}
	noFence := appendOp(1, 1)
	noFence.Fence = nil
	noMsgID := appendOp(1, 1)
	noMsgID.GetAppend().Entries[0].MsgId = nil
	tookQoS1 := appendOp(1, 1)
	tookQoS1.GetAppend().Entries[0].TookQos2 = true
	return map[string]*persistencev1.WriteOp{
		"oversized_payload": withMsg(big),
		"wildcard_topic":    withMsg(wild),
		"other_tenant":      withMsg(other),
		"msgid_mismatch":    mismatch,
		"no_session":        noSession,
		"bad_tenant":        badTenant,
		"no_fence":          noFence,
		"no_msgid":          noMsgID,
		"took_qos2_at_qos1": tookQoS1,
		"no_kind":           {Session: sess, Fence: fence(1)},
		"bad_qos":           {Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_PutSubscription{PutSubscription: &persistencev1.PutSubscriptionOp{Subscription: &persistencev1.Subscription{Filter: "a", Qos: 3}}}},
		"bad_filter":        {Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_PutSubscription{PutSubscription: &persistencev1.PutSubscriptionOp{Subscription: &persistencev1.Subscription{Filter: "a/#/b"}}}},
		"packet_id_zero":    {Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_Send{Send: &persistencev1.SendOp{Entries: []*persistencev1.Entry{{MsgId: mid(1), Qos: 1}}}}},
		"packet_id_big":     {Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_Pubrel{Pubrel: &persistencev1.PubrelOp{PacketId: 70000}}},
		"empty_complete":    {Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_Complete{Complete: &persistencev1.CompleteOp{}}},
		"retained_session":  {Session: sess, Op: &persistencev1.WriteOp_PutRetained{PutRetained: &persistencev1.PutRetainedOp{Message: pmsg(1)}}},
		"bad_protocol":      {Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_PutSession{PutSession: &persistencev1.PutSessionOp{Session: &persistencev1.Session{ProtocolVersion: 9}}}},
	}
}

func TestServer_Write_InvalidStoresNothing(t *testing.T) {
	t.Parallel()
	ts := startServer(t, boltStore(t))
	w := newWriter(t, ts.client)
	for name, op := range badOps() {
		t.Run(name, func(t *testing.T) {
			// The good op before the bad one is not applied either.
			resp := w.write(appendOp(1, 100), op)
			require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT, resp.GetStatus())
			require.NotEmpty(t, resp.GetError())
			require.Empty(t, resp.GetResults())
		})
	}
	st := load(t, ts.client)
	require.Empty(t, st.GetQueue())
	require.Zero(t, st.GetEpoch())
	// The stream still works.
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, w.write(activate(1)).GetStatus())
	resp := w.write()
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT, resp.GetStatus(), "empty batch")
}

func TestServer_LookupRetained(t *testing.T) {
	t.Parallel()
	ts := startServer(t, boltStore(t))
	w := newWriter(t, ts.client)
	var ops []*persistencev1.WriteOp
	for i, tp := range []string{"a/b", "a/c", "$SYS/x", "b"} {
		m := pmsg(uint64(i + 1))
		m.Topic, m.Retain = tp, true
		ops = append(ops, &persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutRetained{PutRetained: &persistencev1.PutRetainedOp{Message: m}}})
	}
	resp := w.write(ops...)
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
	require.True(t, resp.GetResults()[0].GetChanged())
	lk := func(filter string) ([]*commonv1.Message, error) {
		r, err := ts.client.LookupRetained(t.Context(), connect.NewRequest(&persistencev1.LookupRetainedRequest{Tenant: "acme", Filter: filter}))
		if err != nil {
			return nil, err
		}
		return r.Msg.GetMessages(), nil
	}
	got, err := lk("a/+")
	require.NoError(t, err)
	require.Len(t, got, 2)
	got, err = lk("#")
	require.NoError(t, err)
	require.Len(t, got, 3, "not $SYS")
	for _, bad := range []string{"a/#/b", "", "$share/g/#"} {
		_, err = lk(bad)
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), bad)
	}
	_, err = ts.client.LoadSession(t.Context(), connect.NewRequest(&persistencev1.LoadSessionRequest{}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
}

// With its only replica gone, nothing is acknowledged: the batch says
// NOT_REPLICATED (WAIT timed out) or UNAVAILABLE (min-replicas refusal).
func TestServer_Write_NotReplicated(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g := redistest.StartGroup(t, 1, 0) // the primary accepts writes; only WAIT notices
	rs, err := redisstore.New(redisstore.Config{Addr: g.Primary.Addr, MinReplicas: 1, WaitTimeout: 200 * time.Millisecond}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = rs.Close() })
	ts := startServer(t, rs)
	w := newWriter(t, ts.client)
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, w.write(activate(1), appendOp(1, 1)).GetStatus())
	g.Replicas[0].Kill()
	testutil.Eventually(t, 10*time.Second, func() error {
		if st := w.write(appendOp(1, 2)).GetStatus(); st != persistencev1.WriteStatus_WRITE_STATUS_NOT_REPLICATED {
			return fmt.Errorf("status %v", st)
		}
		return nil
	})
	// Acknowledgement deletes do not wait and still succeed.
	resp := w.write(&persistencev1.WriteOp{Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_Dequeue{Dequeue: &persistencev1.DequeueOp{MsgIds: []*commonv1.MsgID{mid(1)}}}})
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
}

func TestParseMsgID(t *testing.T) {
	t.Parallel()
	for _, id := range []*commonv1.MsgID{mid(1), {EdgeId: "x", Incarnation: 0, Seq: 1 << 63}, {EdgeId: "a/b/c/", Incarnation: 5, Seq: 2}} {
		got, err := ParseMsgID(MsgIDString(id))
		require.NoError(t, err)
		require.True(t, proto.Equal(id, got))
	}
}

// An inbound QoS 2 record reads back as it was written, unconfirmed or
// not, whatever its edge ID holds ("~" and "#" included).
func TestIncomingOut_RoundTrip(t *testing.T) {
	t.Parallel()
	for _, edge := range []string{"edge-a", "~edge", "a#b", "~a#ff"} {
		id := &commonv1.MsgID{EdgeId: edge, Incarnation: 3, Seq: 7}
		plain := MsgIDString(id)
		require.True(t, proto.Equal(&persistencev1.Incoming{PacketId: 1, MsgId: id},
			IncomingOut(store.Incoming{PacketID: 1, MsgID: plain})), "confirmed, edge %q", edge)
		require.True(t, proto.Equal(&persistencev1.Incoming{PacketId: 2, MsgId: id, Unconfirmed: true, Fingerprint: 0xabc},
			IncomingOut(store.Incoming{PacketID: 2, MsgID: unconfirmedValue(plain, 0xabc)})), "unconfirmed, edge %q", edge)
	}
}

// An append's took_qos2 entries come back from LoadSession, oldest first,
// after their deliveries completed; a send's mark records nothing, and
// DeleteSession forgets them.
func TestServer_TookQoS2_RoundTrip(t *testing.T) {
	t.Parallel()
	ts := startServer(t, boltStore(t))
	w := newWriter(t, ts.client)
	qos2 := func(seq uint64, took bool) *persistencev1.Entry {
		return &persistencev1.Entry{MsgId: mid(seq), Qos: 2, TookQos2: took}
	}
	a := &persistencev1.AppendOp{Entries: []*persistencev1.Entry{qos2(3, true), qos2(1, false), qos2(2, true)},
		Messages: []*commonv1.Message{pmsg(3), pmsg(1), pmsg(2)}}
	send := &persistencev1.SendOp{}
	for i, seq := range []uint64{3, 1, 2} {
		e := qos2(seq, true)
		e.PacketId = uint32(i + 1)
		send.Entries = append(send.Entries, e)
	}
	resp := w.write(activate(1),
		&persistencev1.WriteOp{Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_Append{Append: a}},
		&persistencev1.WriteOp{Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_Send{Send: send}},
		&persistencev1.WriteOp{Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_Complete{Complete: &persistencev1.CompleteOp{PacketIds: []uint32{1, 2, 3}}}},
	)
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
	st := load(t, ts.client)
	require.Empty(t, st.GetInflight())
	require.Len(t, st.GetTookQos2(), 2)
	require.True(t, proto.Equal(mid(3), st.GetTookQos2()[0]), "oldest first: %v", st.GetTookQos2())
	require.True(t, proto.Equal(mid(2), st.GetTookQos2()[1]))

	resp = w.write(&persistencev1.WriteOp{Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_DeleteSession{DeleteSession: &persistencev1.DeleteSessionOp{}}})
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
	require.Empty(t, load(t, ts.client).GetTookQos2())
}

// An instance refuses the sessions and the retained messages of another
// Redis group's slots, and keeps what its own group's clients write.
func TestServer_OtherGroupRefused(t *testing.T) {
	t.Parallel()
	tab := slots.Even(2)
	own := tab.Session(sess.GetTenant(), sess.GetClientId())
	st := boltStore(t)
	other := startServerWith(t, st, Config{Slots: tab, Group: 1 - own})
	mine := startServerWith(t, st, Config{Slots: tab, Group: own})

	resp := newWriter(t, other.client).write(activate(1), appendOp(1, 1))
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT, resp.GetStatus())
	require.Contains(t, resp.GetError(), fmt.Sprintf("slot %d of Redis group %d; this instance serves group %d",
		slots.Of(sess.GetTenant(), sess.GetClientId()), own, 1-own))
	_, err := other.client.LoadSession(t.Context(), connect.NewRequest(&persistencev1.LoadSessionRequest{Session: sess}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Zero(t, load(t, mine.client).GetEpoch(), "the refused batch stored something")

	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, newWriter(t, mine.client).write(activate(1), appendOp(1, 1)).GetStatus())
	require.Len(t, load(t, mine.client).GetQueue(), 1)

	// Retained messages go by the tenant's slot.
	tenantGroup := tab.Tenant("acme")
	retained := func(ts *testServer) error {
		_, err := ts.client.LookupRetained(t.Context(), connect.NewRequest(&persistencev1.LookupRetainedRequest{Tenant: "acme", Filter: "#"}))
		return err
	}
	byGroup := map[uint32]*testServer{own: mine, 1 - own: other}
	require.NoError(t, retained(byGroup[tenantGroup]))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(retained(byGroup[1-tenantGroup])))
	put := &persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutRetained{PutRetained: &persistencev1.PutRetainedOp{Message: pmsg(9)}}}
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT, newWriter(t, byGroup[1-tenantGroup].client).write(put).GetStatus())
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, newWriter(t, byGroup[tenantGroup].client).write(put).GetStatus())
}

// TestServer_LoadDropsEntriesWhoseMessageIsGone: Redis lets a message body
// go a minute after its MQTT expiry, while the queue and in-flight entries
// that refer to it stay; a load answers without them and removes them
// (counted), so a long-lived session does not keep them until deleted.
func TestServer_LoadDropsEntriesWhoseMessageIsGone(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	t.Parallel()
	g := redistest.StartGroup(t, 0, 0)
	rs, err := redisstore.New(redisstore.Config{Addr: g.Primary.Addr}, testutil.Logger(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = rs.Close() })
	ts := startServer(t, rs)
	w := newWriter(t, ts.client)
	resp := w.write(activate(1), appendOp(1, 1, 2, 3), &persistencev1.WriteOp{Session: sess, Fence: fence(1), Op: &persistencev1.WriteOp_Send{Send: &persistencev1.SendOp{
		Entries: []*persistencev1.Entry{{MsgId: mid(3), Qos: 1, PacketId: 7}}}}})
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
	// The bodies of 1 (queued) and 3 (in flight) expire.
	rdb := g.Primary.Client()
	for _, s := range []uint64{1, 3} {
		k, f := redisstore.BodyKey(MsgIDString(mid(s)), true) // the test messages expire
		require.NoError(t, rdb.HDel(t.Context(), k, f).Err())
	}
	st := load(t, ts.client)
	require.Len(t, st.GetMessages(), 1)
	testutil.Eventually(t, 5*time.Second, func() error {
		ids, err := rdb.HKeys(t.Context(), store.SessionKey{Tenant: "acme", ClientID: "dev-1"}.Tag()+":qe").Result()
		if err != nil {
			return err
		}
		inf, err := rdb.HLen(t.Context(), store.SessionKey{Tenant: "acme", ClientID: "dev-1"}.Tag()+":inf").Result()
		if err != nil {
			return err
		}
		if len(ids) != 1 || ids[0] != MsgIDString(mid(2)) || inf != 0 {
			return fmt.Errorf("queue %v, %d in flight: want only message 2 queued", ids, inf)
		}
		return nil
	})
	st = load(t, ts.client)
	require.Len(t, st.GetQueue(), 1)
	require.Empty(t, st.GetInflight())
	require.Len(t, st.GetMessages(), 1)
}

// TestServer_TenantQueueQuota: the service bounds each tenant's queued
// entries from its own configuration (a tenant of its own over the
// default) for the appends marked as offline queueing; an unmarked append
// (written ahead of a send to a connected client, or an import) is never
// refused by it, and nothing in a request sets the bound.
func TestServer_TenantQueueQuota(t *testing.T) {
	t.Parallel()
	ts := startServerWith(t, boltStore(t), Config{TenantQueues: store.TenantQuotas{Default: 100, For: map[string]int{"acme": 2}}})
	w := newWriter(t, ts.client)
	offline := appendOp(1, 1, 2, 3)
	offline.GetAppend().Limits = &persistencev1.QueueLimits{TenantQuota: true}
	resp := w.write(activate(1), offline)
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
	require.Equal(t, uint32(2), resp.GetResults()[1].GetAdded())
	require.Equal(t, uint32(1), resp.GetResults()[1].GetRefused(), "acme's bound is 2")
	resp = w.write(appendOp(1, 4, 5))
	require.Equal(t, persistencev1.WriteStatus_WRITE_STATUS_OK, resp.GetStatus(), resp.GetError())
	require.Equal(t, uint32(2), resp.GetResults()[0].GetAdded(), "unmarked: not bounded, but counted")
	offline = appendOp(1, 6)
	offline.GetAppend().Limits = &persistencev1.QueueLimits{TenantQuota: true}
	require.Equal(t, uint32(1), w.write(offline).GetResults()[0].GetRefused(), "4 queued against a bound of 2")
	require.Len(t, load(t, ts.client).GetQueue(), 4)

	ctx := context.Background()
	u, err := ts.client.TenantUsage(ctx, connect.NewRequest(&persistencev1.TenantUsageRequest{Tenant: "acme"}))
	require.NoError(t, err)
	require.Equal(t, uint64(4), u.Msg.GetQueued())
	require.Equal(t, uint64(2), u.Msg.GetQueueMax())
	u, err = ts.client.TenantUsage(ctx, connect.NewRequest(&persistencev1.TenantUsageRequest{Tenant: "other"}))
	require.NoError(t, err)
	require.True(t, proto.Equal(&persistencev1.TenantUsageResponse{QueueMax: 100}, u.Msg), "nothing held, the default bound: %v", u.Msg)
	_, err = ts.client.TenantUsage(ctx, connect.NewRequest(&persistencev1.TenantUsageRequest{Tenant: "Bad Tenant"}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	_, err = ts.client.DescribeGroup(ctx, connect.NewRequest(&persistencev1.DescribeGroupRequest{}))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "the embedded store has no Redis group")
}
