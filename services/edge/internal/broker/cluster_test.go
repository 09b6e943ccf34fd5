package broker

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

type fakeOwnership struct {
	claim func(tenant, clientID string) (uint64, string, error)
}

func (f fakeOwnership) Claim(_ context.Context, tenant, clientID string) (Grant, error) {
	epoch, previous, err := f.claim(tenant, clientID)
	return Grant{Epoch: epoch, Previous: previous}, err
}
func (fakeOwnership) Release(context.Context, string, string, uint64) error { return nil }

type fakeRoutes struct {
	add     func(tenant, filter, group string) error
	removed atomic.Int32
}

func (f *fakeRoutes) Add(_ context.Context, tenant, filter, group string) error {
	return f.add(tenant, filter, group)
}
func (f *fakeRoutes) Remove(context.Context, string, string, string) error {
	f.removed.Add(1)
	return nil
}

type countingOutput struct{ n atomic.Int32 }

func (o *countingOutput) Offer(*Message) bool { o.n.Add(1); return true }

// The edge goes through its cluster interfaces: a claim before CONNACK, a
// route before SUBACK, every publish offered to the output.
func TestBroker_ClusterInterfaces(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	var claims []string
	routes := &fakeRoutes{add: func(_, filter, _ string) error {
		switch filter {
		case "refused":
			return fmt.Errorf("%w: wildcard cap", ErrRouteRefused)
		case "unconfirmed":
			return context.DeadlineExceeded
		}
		return nil
	}}
	out := &countingOutput{}
	b.SetCluster(Cluster{
		Ownership: fakeOwnership{claim: func(tenant, clientID string) (uint64, string, error) {
			claims = append(claims, tenant+"/"+clientID)
			if clientID == "unlucky" {
				return 0, "", errors.New("no leader")
			}
			return 7, "", nil
		}},
		Routes: routes,
		Output: out,
	})
	c := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, c.Connect("dev", true, packets.Properties{}).ReasonCode)
	require.Equal(t, []string{"default/dev"}, claims)

	bad := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.ErrServerUnavailable.Code, bad.Connect("unlucky", true, packets.Properties{}).ReasonCode)

	require.Equal(t, []byte{1}, c.Subscribe(1, "ok", 1).ReasonCodes)
	require.GreaterOrEqual(t, c.Subscribe(2, "refused", 1).ReasonCodes[0], byte(0x80))
	require.Zero(t, routes.removed.Load(), "a refused route counts nothing to remove")
	// Not confirmed in time: refused to the client, and the route, which
	// may still land, goes again.
	require.GreaterOrEqual(t, c.Subscribe(5, "unconfirmed", 1).ReasonCodes[0], byte(0x80))
	require.Equal(t, int32(1), routes.removed.Load())
	c.Publish(3, "ok", 1, []byte("x"))
	c.Expect(packets.Puback)
	require.Equal(t, int32(1), out.n.Load())
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Unsubscribe, Qos: 1}, PacketID: 4, Filters: packets.Subscriptions{{Filter: "ok"}}})
	c.Expect(packets.Unsuback)
	require.Equal(t, int32(2), routes.removed.Load())
}

// A fenced edge disconnects everyone with 0x8B, admits nobody (0x88) and
// acknowledges nothing until it is unfenced.
func TestBroker_Fence(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("c", true, packets.Properties{})
	b.Fence()
	require.Equal(t, packets.ErrServerShuttingDown.Code, c.Expect(packets.Disconnect).ReasonCode)
	refused := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.ErrServerUnavailable.Code, refused.Connect("d", true, packets.Properties{}).ReasonCode)
	b.Unfence()
	ok := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.CodeSuccess.Code, ok.Connect("e", true, packets.Properties{}).ReasonCode)
	ok.Publish(1, "x", 1, []byte("y"))
	ok.Expect(packets.Puback)
}

// A session that ends takes its routes with it.
func TestBroker_SessionEndRemovesRoutes(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	routes := &fakeRoutes{add: func(string, string, string) error { return nil }}
	b.SetCluster(Cluster{Routes: routes})
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("c", true, packets.Properties{})
	c.Subscribe(1, "a/#", 1)
	c.Subscribe(2, "$share/g/b", 1)
	_ = c.Conn.Close()
	require.Eventually(t, func() bool { return routes.removed.Load() == 2 }, 5*time.Second, 10*time.Millisecond)
}

// Another edge's claim closes the local connection with 0x8E, but only a
// claim newer than the one the session holds here.
func TestBroker_TakeOver(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("x", true, packets.Properties{})
	// mochi binds the session after it has written the CONNACK.
	var s *session
	require.Eventually(t, func() bool {
		s = b.session(b.mustScope(t, "default").ClientID("x"))
		if s == nil {
			return false
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.client != nil
	}, 5*time.Second, time.Millisecond)
	s.mu.Lock()
	epoch := s.epoch
	s.mu.Unlock()

	owned, connected, _, err := b.TakeOver(t.Context(), "default", "x", "other", epoch, false)
	require.NoError(t, err)
	require.False(t, owned, "a claim no newer than the session's own is stale")
	require.False(t, connected)
	owned, connected, _, _ = b.TakeOver(t.Context(), "default", "nobody", "other", epoch+1, false)
	require.False(t, owned)
	require.False(t, connected)

	owned, connected, _, _ = b.TakeOver(t.Context(), "default", "x", "other", epoch+1, false)
	require.True(t, owned)
	require.True(t, connected)
	require.Equal(t, packets.ErrSessionTakenOver.Code, c.Expect(packets.Disconnect).ReasonCode)
}

func (b *Broker) mustScope(t *testing.T, tenant string) *tenancy.Scope {
	t.Helper()
	sc, err := b.scope(tenant)
	require.NoError(t, err)
	return sc
}

// Another edge's claim that lands while CONNECTs of the same client ID are
// in flight here refuses them all, however many there are (a client that
// gave up waiting for its CONNACK connected again): the one claiming, and
// the one waiting behind it to claim (sessionLocks); a claim the
// coordinator answers as superseded is refused too (invariant 3).
func TestBroker_TakeOverRefusesEveryConnectInFlight(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, nil)
	claimed := make(chan struct{}, 3)
	release := make(chan struct{})
	var epochs atomic.Uint64
	b.SetCluster(Cluster{Ownership: fakeOwnership{claim: func(_, clientID string) (uint64, string, error) {
		if clientID == "late" {
			return 0, "", fmt.Errorf("claim session: %w", ErrClaimSuperseded)
		}
		claimed <- struct{}{}
		<-release
		return epochs.Add(1), "", nil
	}}})
	codes := make(chan byte, 2)
	for range 2 {
		c := mqtttest.Dial(t, addr, 5)
		go func() { codes <- c.Connect("x", false, packets.Properties{}).ReasonCode }()
	}
	<-claimed
	id := b.mustScope(t, "default").ClientID("x")
	require.Eventually(t, func() bool {
		b.claims.mu.Lock()
		defer b.claims.mu.Unlock()
		return len(b.claims.byID[id]) == 2
	}, 5*time.Second, 5*time.Millisecond, "both CONNECTs in flight")
	owned, _, _, err := b.TakeOver(t.Context(), "default", "x", "other", 100, false)
	require.NoError(t, err)
	require.False(t, owned, "nothing is bound here yet")
	close(release)
	for range 2 {
		require.Equal(t, packets.ErrServerUnavailable.Code, <-codes)
	}
	require.Nil(t, b.session(id))

	late := mqtttest.Dial(t, addr, 5)
	require.Equal(t, packets.ErrServerUnavailable.Code, late.Connect("late", false, packets.Properties{}).ReasonCode)
	require.Equal(t, 3.0, promtest.ToFloat64(b.m.connects.WithLabelValues("claim_superseded")))
}
