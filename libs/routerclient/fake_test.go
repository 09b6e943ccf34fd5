package routerclient

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
	"github.com/keelmq/keel/proto/gen/keel/router/v1/routerv1connect"
)

// fakeRouter is a scripted RouterService: it records what edges send, acks
// deltas and snapshots, heartbeats while hb is on, and answers Lookup with
// the lookup function field. Tests push router messages with push.
type fakeRouter struct {
	routerv1connect.UnimplementedRouterServiceHandler

	lease  time.Duration
	hbOn   atomic.Bool
	ackOn  atomic.Bool
	match  atomic.Bool                                                     // digest answer
	reject func(*routerv1.RouteDelta) string                               // non-empty: reject the delta; may be nil
	lookup func(*routerv1.LookupRequest) (*routerv1.LookupResponse, error) // may be nil
	url    string

	mu        sync.Mutex
	hellos    []*routerv1.RouteSyncHello
	msgs      []*routerv1.RouteSyncRequest // every non-ack message, in arrival order
	deltas    []*routerv1.RouteDelta
	snapshots []*routerv1.RouteSetSnapshot
	lookups   int
	cur       chan *routerv1.RouteSyncResponse // current stream's outbox
	kill      context.CancelFunc               // ends the current stream
	opened    chan struct{}                    // closed and replaced on every new stream
}

// startFake serves a fakeRouter on loopback h2c and returns it.
func startFake(t *testing.T, lease time.Duration) *fakeRouter {
	t.Helper()
	f := &fakeRouter{lease: lease, opened: make(chan struct{})}
	f.hbOn.Store(true)
	f.ackOn.Store(true)
	f.match.Store(true)
	mux := http.NewServeMux()
	mux.Handle(routerv1connect.NewRouterServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	f.url = srv.URL
	return f
}

func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p, ForceAttemptHTTP2: true}}
}

// startClient runs a client against urls[0] (others as fallbacks) until the
// test ends.
func startClient(t *testing.T, mut func(*Config), urls ...string) *Client {
	t.Helper()
	cfg := Config{URL: urls[0], FallbackURLs: urls[1:], EdgeID: "edge-1", Incarnation: 1, HTTPClient: h2cClient()}
	if mut != nil {
		mut(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return c
}

func (f *fakeRouter) waitReady(t *testing.T, c *Client) {
	t.Helper()
	eventually(t, func() bool { return c.Ready() })
}

func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// push queues msg on the current stream.
func (f *fakeRouter) push(msg *routerv1.RouteSyncResponse) {
	f.mu.Lock()
	ch := f.cur
	f.mu.Unlock()
	ch <- msg
}

// breakStream ends the current stream from the router side.
func (f *fakeRouter) breakStream() {
	f.mu.Lock()
	k := f.kill
	f.mu.Unlock()
	k()
}

func (f *fakeRouter) Lookup(_ context.Context, req *connect.Request[routerv1.LookupRequest]) (*connect.Response[routerv1.LookupResponse], error) {
	f.mu.Lock()
	f.lookups++
	fn := f.lookup
	f.mu.Unlock()
	if fn == nil {
		return connect.NewResponse(&routerv1.LookupResponse{CacheLease: durationpb.New(f.lease)}), nil
	}
	resp, err := fn(req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeRouter) lookupCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lookups
}

func (f *fakeRouter) RouteSync(ctx context.Context, st *connect.BidiStream[routerv1.RouteSyncRequest, routerv1.RouteSyncResponse]) error {
	first, err := st.Receive()
	if err != nil {
		return err
	}
	if first.GetHello() == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("no hello"))
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := make(chan *routerv1.RouteSyncResponse, 1024)
	// The stream's first messages are queued before a test can push to it
	// (push, opened): a push between would go ahead of the reset, which
	// would then empty what it pushed.
	out <- &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Wildcard{Wildcard: &routerv1.WildcardDeltas{Reset_: true}}}
	out <- &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Ready{Ready: &routerv1.RouteReady{}}}
	f.mu.Lock()
	f.hellos = append(f.hellos, first.GetHello())
	f.cur, f.kill = out, cancel
	close(f.opened)
	f.opened = make(chan struct{})
	f.mu.Unlock()

	var echo atomic.Int64 // edge clock of the latest ack, echoed as the router does
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		t := time.NewTicker(f.lease / 8)
		defer t.Stop()
		var seq uint64
		for {
			var msg *routerv1.RouteSyncResponse
			select {
			case <-ctx.Done():
				return
			case msg = <-out:
			case <-t.C:
				if !f.hbOn.Load() {
					continue
				}
				msg = &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Heartbeat{Heartbeat: &routerv1.RouteHeartbeat{CacheLease: durationpb.New(f.lease), Echo: echo.Load()}}}
			}
			seq++
			msg.Seq = seq
			if st.Send(msg) != nil {
				cancel()
				return
			}
		}
	})
	recv := make(chan *routerv1.RouteSyncRequest)
	go func() {
		for {
			req, err := st.Receive()
			if err != nil {
				cancel()
				return
			}
			select {
			case recv <- req:
			case <-ctx.Done():
				return
			}
		}
	}()
	for {
		var req *routerv1.RouteSyncRequest
		select {
		case <-ctx.Done():
			return nil
		case req = <-recv:
		}
		if a := req.GetAck(); a != nil {
			if a.GetEdgeClock() > 0 {
				echo.Store(a.GetEdgeClock())
			}
			continue
		}
		f.mu.Lock()
		f.msgs = append(f.msgs, req)
		f.mu.Unlock()
		switch m := req.GetMsg().(type) {
		case *routerv1.RouteSyncRequest_Deltas:
			ack := &routerv1.RouteAck{}
			f.mu.Lock()
			for _, d := range m.Deltas.GetDeltas() {
				f.deltas = append(f.deltas, d)
				ack.Seq = d.GetSeq()
				if f.reject != nil {
					if r := f.reject(d); r != "" {
						ack.Rejected = append(ack.Rejected, &routerv1.RouteReject{Seq: d.GetSeq(), Reason: r})
					}
				}
			}
			f.mu.Unlock()
			if f.ackOn.Load() {
				out <- &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Ack{Ack: ack}}
			}
		case *routerv1.RouteSyncRequest_Digest:
			out <- &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_DigestResult{DigestResult: &routerv1.RouteDigestResult{Seq: m.Digest.GetSeq(), Match: f.match.Load()}}}
		case *routerv1.RouteSyncRequest_Snapshot:
			f.mu.Lock()
			f.snapshots = append(f.snapshots, m.Snapshot)
			f.mu.Unlock()
			if m.Snapshot.GetLast() && f.ackOn.Load() {
				out <- &routerv1.RouteSyncResponse{Msg: &routerv1.RouteSyncResponse_Ack{Ack: &routerv1.RouteAck{Seq: m.Snapshot.GetSeq()}}}
			}
		}
	}
}

func (f *fakeRouter) received() (msgs []*routerv1.RouteSyncRequest, deltas []*routerv1.RouteDelta, hellos []*routerv1.RouteSyncHello) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*routerv1.RouteSyncRequest(nil), f.msgs...), append([]*routerv1.RouteDelta(nil), f.deltas...),
		append([]*routerv1.RouteSyncHello(nil), f.hellos...)
}
