package outputclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/rpc"
	ktestutil "github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/libs/topic"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	outputv1 "github.com/keelmq/keel/proto/gen/keel/output/v1"
	"github.com/keelmq/keel/proto/gen/keel/output/v1/outputv1connect"
)

func ruleFilters(version uint64, byTenant ...any) *outputv1.RuleFilters {
	f := &outputv1.RuleFilters{Version: version}
	for i := 0; i < len(byTenant); i += 2 {
		f.Tenants = append(f.Tenants, &outputv1.TenantFilters{Tenant: byTenant[i].(string), Filters: byTenant[i+1].([]string)})
	}
	return f
}

// TestMatcher_Match checks the matcher against the reference matcher
// topic.Match, per tenant and for the entry of every tenant.
func TestMatcher_Match(t *testing.T) {
	t.Parallel()
	f := ruleFilters(4,
		"acme", []string{"sensors/#", "a/+/c"},
		"beta", []string{"x"},
		"delta", []string{"#"},
		"gamma", []string{},
		AllTenants, []string{"all/#", "$SYS/broker/#"},
	)
	m := newMatcher(f)
	require.Equal(t, uint64(4), m.version)
	for _, tc := range []struct {
		tenant, topic string
		want          bool
	}{
		{"acme", "sensors", true},
		{"acme", "sensors/1/temp", true},
		{"acme", "a/b/c", true},
		{"acme", "a/b", false},
		{"acme", "x", false},
		{"beta", "x", true},
		{"beta", "sensors/1", false},
		{"gamma", "x", false},
		{"gamma", "all/1", true},
		{"zeta", "all", true},
		{"zeta", "sensors/1", false},
		{"acme", "$SYS/broker/load", true},
		{"delta", "anything/at/all", true},
		{"delta", "$SYS/x", false},
		{"acme", "", false},
		{"delta", "", false},
	} {
		t.Run(tc.tenant+":"+tc.topic, func(t *testing.T) {
			require.Equal(t, tc.want, m.match(tc.tenant, tc.topic))
			if tc.topic == "" {
				return
			}
			ref := false
			for _, tf := range f.GetTenants() {
				if tf.GetTenant() != tc.tenant && tf.GetTenant() != AllTenants {
					continue
				}
				for _, fl := range tf.GetFilters() {
					ref = ref || topic.Match(fl, tc.topic)
				}
			}
			require.Equal(t, ref, tc.want, "reference matcher")
		})
	}
	require.False(t, newMatcher(ruleFilters(1)).match("acme", "x"), "an empty set matches nothing")
}

// TestClient_Offer_Filters offers without a filter set (everything is
// queued), with one (only matching messages are built and queued, the rest
// counted as skipped) and after the output service stopped sending one.
func TestClient_Offer_Filters(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	c, err := New(Config{URL: "http://127.0.0.1:1", DropLogInterval: time.Hour}, logging.Discard(), reg)
	require.NoError(t, err)
	built := 0
	offer := func(tenant, name string) bool {
		return c.Offer(tenant, name, func() *commonv1.Message {
			built++
			return &commonv1.Message{Tenant: tenant, Topic: name}
		})
	}

	_, ok := c.Filters()
	require.False(t, ok)
	require.True(t, offer("acme", "other/1"))
	require.Equal(t, 1, built, "no filter set yet: everything is offered")
	require.Equal(t, 1, c.QueueLen())

	c.setFilters(ruleFilters(2, "acme", []string{"sensors/#"}))
	v, ok := c.Filters()
	require.True(t, ok)
	require.Equal(t, uint64(2), v)
	require.Equal(t, 2.0, gauge(t, reg, "keel_edge_output_filters_version"))
	require.True(t, offer("acme", "other/1"))
	require.True(t, offer("beta", "sensors/1"))
	require.True(t, c.OfferMessage(&commonv1.Message{Tenant: "acme", Topic: "other/2"}))
	require.Equal(t, 1, built, "nothing built for a message no rule matches")
	require.Equal(t, 1, c.QueueLen())
	require.True(t, offer("acme", "sensors/1"))
	require.True(t, c.OfferMessage(&commonv1.Message{Tenant: "acme", Topic: "sensors/2"}))
	require.Equal(t, 2, built)
	require.Equal(t, 3, c.QueueLen())
	st := c.Stats()
	require.Equal(t, Stats{Offered: 6, Skipped: 3, Queued: 3}, st)
	require.Equal(t, 3.0, gauge(t, reg, "keel_edge_output_skipped_total"))

	c.setFilters(nil)
	require.Zero(t, gauge(t, reg, "keel_edge_output_filters_version"))
	require.True(t, offer("beta", "x"))
	require.Equal(t, 3, built)
	require.Equal(t, 4, c.QueueLen())
}

// gauge returns the value of an unlabelled counter or gauge.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		m := f.GetMetric()[0]
		if m.Counter != nil {
			return m.GetCounter().GetValue()
		}
		return m.GetGauge().GetValue()
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// filterlessService answers Publish as output services did before they
// sent filters: one ack per batch and nothing else.
type filterlessService struct {
	outputv1connect.UnimplementedOutputServiceHandler
	records atomic.Int64
}

func (s *filterlessService) Publish(_ context.Context, st *connect.BidiStream[outputv1.PublishRequest, outputv1.PublishResponse]) error {
	for {
		req, err := st.Receive()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		s.records.Add(int64(len(req.GetRecords())))
		if err := st.Send(&outputv1.PublishResponse{BatchId: req.GetBatchId(), Accepted: uint32(len(req.GetRecords())), CreditBytes: 1 << 20}); err != nil {
			return err
		}
	}
}

// TestClient_FilterlessService_OffersEverything streams to an output
// service that sends no filters, with the filter set of an earlier stream
// still in use: the first response of the stream (the ack of the empty
// batch that opens it) drops that set, and every message is sent.
func TestClient_FilterlessService_OffersEverything(t *testing.T) {
	t.Parallel()
	svc := &filterlessService{}
	mux := http.NewServeMux()
	mux.Handle(outputv1connect.NewOutputServiceHandler(svc, rpc.HandlerOptions()...))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = rpc.ServerProtocols()
	srv.Start()
	t.Cleanup(srv.Close)

	c, err := New(Config{URL: srv.URL, EdgeID: "edge-1"}, ktestutil.Logger(t), nil)
	require.NoError(t, err)
	c.setFilters(ruleFilters(9, "acme", []string{"sensors/#"}))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	ktestutil.Eventually(t, 10*time.Second, func() error {
		if _, ok := c.Filters(); ok {
			return errors.New("filter set of the earlier stream still in use")
		}
		return nil
	})
	const n = 20
	for i := range n {
		require.True(t, c.OfferMessage(&commonv1.Message{Tenant: "acme", Topic: fmt.Sprintf("other/%d", i)}))
	}
	ktestutil.Eventually(t, 10*time.Second, func() error {
		if got := svc.records.Load(); got != n {
			return fmt.Errorf("service received %d of %d", got, n)
		}
		return nil
	})
	require.Zero(t, c.Stats().Skipped)
}

// edgeMessage stands for the edge's own message type: its cluster form is
// built on demand, as the edge's output sink does.
type edgeMessage struct {
	tenant, topic string
	payload       []byte
	seq           uint64
}

func (m *edgeMessage) Proto() *commonv1.Message {
	return &commonv1.Message{
		Id:     &commonv1.MsgID{EdgeId: "edge-1", Incarnation: 1, Seq: m.seq},
		Tenant: m.tenant, Topic: m.topic, Payload: m.payload, Qos: 1, ClientId: "c1",
		IngressUnixNano: 1,
	}
}

// BenchmarkClient_Offer measures Offer on the edge's publish path with a
// filter set of 100 tenants × 10 rules ("site/+/rule<j>/#") in use: a
// message no rule matches whose topic walks the wildcard branch (skip), one
// whose first level no filter has (skip-prefix), one of a tenant without
// rules (skip-tenant), skip from every core (skip-parallel), and one a rule
// matches, built and queued (match; the queue is emptied every 1024 offers,
// as the sender would).
//
//	go test -run '^$' -bench BenchmarkClient_Offer -benchmem ./libs/outputclient
func BenchmarkClient_Offer(b *testing.B) {
	var args []any
	for i := range 100 {
		fs := make([]string, 0, 10)
		for j := range 10 {
			fs = append(fs, fmt.Sprintf("site/+/rule%d/#", j))
		}
		args = append(args, fmt.Sprintf("tenant-%d", i), fs)
	}
	newClient := func(b *testing.B) *Client {
		c, err := New(Config{URL: "http://127.0.0.1:1", DropLogInterval: time.Hour, QueueRecords: 1 << 20, QueueBytes: 1 << 40},
			logging.Discard(), prometheus.NewRegistry())
		require.NoError(b, err)
		c.setFilters(ruleFilters(1, args...))
		return c
	}
	payload := make([]byte, 256)
	skip := &edgeMessage{tenant: "tenant-42", topic: "site/dev-7/telemetry/temp", payload: payload}
	match := &edgeMessage{tenant: "tenant-42", topic: "site/dev-7/rule3/temp", payload: payload}

	b.Run("skip", func(b *testing.B) {
		c := newClient(b)
		b.ReportAllocs()
		for b.Loop() {
			c.Offer(skip.tenant, skip.topic, skip.Proto)
		}
		require.Equal(b, c.Stats().Offered, c.Stats().Skipped)
	})
	b.Run("skip-prefix", func(b *testing.B) {
		c := newClient(b)
		other := &edgeMessage{tenant: "tenant-42", topic: "chat/room-1/msg", payload: payload}
		b.ReportAllocs()
		for b.Loop() {
			c.Offer(other.tenant, other.topic, other.Proto)
		}
		require.Equal(b, c.Stats().Offered, c.Stats().Skipped)
	})
	b.Run("skip-tenant", func(b *testing.B) {
		c := newClient(b)
		other := &edgeMessage{tenant: "no-rules", topic: match.topic, payload: payload}
		b.ReportAllocs()
		for b.Loop() {
			c.Offer(other.tenant, other.topic, other.Proto)
		}
		require.Equal(b, c.Stats().Offered, c.Stats().Skipped)
	})
	b.Run("skip-parallel", func(b *testing.B) {
		c := newClient(b)
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				c.Offer(skip.tenant, skip.topic, skip.Proto)
			}
		})
	})
	b.Run("match", func(b *testing.B) {
		c := newClient(b)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if !c.Offer(match.tenant, match.topic, match.Proto) {
				b.Fatal("queue full")
			}
			if i++; i%1024 == 0 {
				c.take(1024, 1<<40)
			}
		}
		require.Zero(b, c.Stats().Skipped)
	})
}

// holdingService receives batches and acknowledges none of them.
type holdingService struct {
	outputv1connect.UnimplementedOutputServiceHandler
	got chan struct{}
}

func (s *holdingService) Publish(ctx context.Context, st *connect.BidiStream[outputv1.PublishRequest, outputv1.PublishResponse]) error {
	for {
		req, err := st.Receive()
		if err != nil {
			return err
		}
		if len(req.GetRecords()) > 0 {
			select {
			case s.got <- struct{}{}:
			default:
			}
		}
	}
}

// TestClient_UnackedSurviveFailedReconnects sends a batch to an output
// service that takes it without acknowledging and then goes away. While it
// is away every reconnection fails; the batch must still be sent, whole, to
// the instance that comes back on the same address.
func TestClient_UnackedSurviveFailedReconnects(t *testing.T) {
	t.Parallel()
	serve := func(ln net.Listener, svc outputv1connect.OutputServiceHandler) *http.Server {
		mux := http.NewServeMux()
		mux.Handle(outputv1connect.NewOutputServiceHandler(svc, rpc.HandlerOptions()...))
		srv := &http.Server{Handler: mux, Protocols: rpc.ServerProtocols(), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		return srv
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	holder := &holdingService{got: make(chan struct{}, 1)}
	first := serve(ln, holder)

	c, err := New(Config{URL: "http://" + addr, EdgeID: "edge-1", BackoffMin: 5 * time.Millisecond, BackoffMax: 20 * time.Millisecond}, ktestutil.Logger(t), nil)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	const n = 10
	for i := range n {
		require.True(t, c.OfferMessage(&commonv1.Message{Tenant: "acme", Topic: fmt.Sprintf("t/%d", i)}))
	}
	select {
	case <-holder.got:
	case <-time.After(10 * time.Second):
		t.Fatal("the first instance received nothing")
	}
	require.NoError(t, first.Close())
	// Reconnections fail (connection refused) for a while.
	time.Sleep(300 * time.Millisecond)

	ln, err = net.Listen("tcp", addr)
	require.NoError(t, err)
	svc := &filterlessService{}
	second := serve(ln, svc)
	t.Cleanup(func() { _ = second.Close() })
	ktestutil.Eventually(t, 10*time.Second, func() error {
		if got := svc.records.Load(); got != n {
			return fmt.Errorf("the second instance received %d of %d", got, n)
		}
		return nil
	})
	require.Zero(t, c.Stats().Dropped)
}
