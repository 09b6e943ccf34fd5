package rpc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/keelmq/keel/libs/testutil"
)

const holdProcedure = "/keel.test.Hold/Hold"

// holdServer serves a unary call that answers once release is closed (at
// once after that, and at once to the message "now"), as the services'
// servers are configured, and counts the calls in its handler.
func holdServer(t *testing.T) (addr string, inside *atomic.Int64, release chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	inside, release = &atomic.Int64{}, make(chan struct{})
	mux := http.NewServeMux()
	mux.Handle(holdProcedure, connect.NewUnaryHandler(holdProcedure,
		func(ctx context.Context, req *connect.Request[wrapperspb.BytesValue]) (*connect.Response[wrapperspb.BytesValue], error) {
			if string(req.Msg.GetValue()) == "now" {
				return connect.NewResponse(req.Msg), nil
			}
			inside.Add(1)
			defer inside.Add(-1)
			select {
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return connect.NewResponse(req.Msg), nil
		}, HandlerOptions()...))
	serve(t, Buffered(ln), mux)
	return ln.Addr().String(), inside, release
}

func holdCall(ctx context.Context, hc *http.Client, baseURL string) error {
	return call(ctx, hc, baseURL, "x")
}

func call(ctx context.Context, hc *http.Client, baseURL, msg string) error {
	c := connect.NewClient[wrapperspb.BytesValue, wrapperspb.BytesValue](hc, baseURL+holdProcedure, ClientOptions()...)
	_, err := c.CallUnary(ctx, connect.NewRequest(wrapperspb.Bytes([]byte(msg))))
	return err
}

// A burst of calls at once, as an edge's session releases after a connect
// storm, shares the connection its lease renewals use: with the server's
// default stream limit, or over HTTP/1.1, it opened hundreds.
func TestLeaseClient_ConcurrentCallsShareOneConnection(t *testing.T) {
	t.Parallel()
	addr, inside, release := holdServer(t)
	proxy := testutil.NewProxy(t, addr)
	hc, base := LeaseClient(), "http://"+proxy.Addr()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The lease's connection is open long before a storm: the server's
	// SETTINGS, and its stream limit, are known (they come before an
	// answer).
	require.NoError(t, call(ctx, hc, base, "now"))

	const calls = 2000
	errs := make(chan error, calls)
	var wg sync.WaitGroup
	for range calls {
		wg.Go(func() { errs <- holdCall(ctx, hc, base) })
	}
	testutil.Eventually(t, 20*time.Second, func() error {
		if n := inside.Load(); n < calls {
			return fmt.Errorf("%d of %d calls in the handler", n, calls)
		}
		return nil
	})
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, 1, proxy.Accepted(), "every call on the one connection")
}

// A connection that went silent (its peer gone without closing it) is
// given up within LeaseSilence, and the next call goes on a new one: a
// lease renewal gets through well within a lease. H2CClient's pings would
// keep the dead connection 15 s.
func TestLeaseClient_GivesUpASilentConnection(t *testing.T) {
	t.Parallel()
	addr, _, release := holdServer(t)
	close(release)
	proxy := testutil.NewProxy(t, addr)
	hc, base := LeaseClient(), "http://"+proxy.Addr()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	require.NoError(t, holdCall(ctx, hc, base))
	cancel()

	proxy.Stall()
	stalled := time.Now()
	for {
		// Each try as a renewal makes it: bounded, then again.
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		err := holdCall(ctx, hc, base)
		cancel()
		if err == nil {
			break
		}
		require.Less(t, time.Since(stalled), LeaseSilence+2*time.Second, "still on the silent connection: %v", err)
		time.Sleep(100 * time.Millisecond)
	}
	require.Equal(t, 2, proxy.Accepted(), "the next call on a new connection")
}

// After a call that timed out (a peer that answers pings but not calls),
// RedialAfter leaves the connection and the next call dials a new one.
func TestRedialAfter_ATimedOutCallLeavesTheConnection(t *testing.T) {
	t.Parallel()
	addr, _, _ := holdServer(t) // never released: "x" hangs, "now" answers
	proxy := testutil.NewProxy(t, addr)
	hc, base := LeaseClient(), "http://"+proxy.Addr()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, call(ctx, hc, base, "now"))

	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	err := holdCall(short, hc, base)
	cancelShort()
	require.Equal(t, connect.CodeDeadlineExceeded, connect.CodeOf(err))
	RedialAfter(hc, err)
	require.NoError(t, call(ctx, hc, base, "now"))
	require.Equal(t, 2, proxy.Accepted(), "the call after the timed-out one on a new connection")

	// An answer the peer gave (here: a refusal) says nothing of the
	// connection: it stays.
	RedialAfter(hc, connect.NewError(connect.CodeInvalidArgument, errors.New("refused")))
	require.NoError(t, call(ctx, hc, base, "now"))
	require.Equal(t, 2, proxy.Accepted())
}
