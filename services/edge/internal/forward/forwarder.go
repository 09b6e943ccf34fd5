package forward

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Peer is another edge and the URL of its edge API.
type Peer struct {
	ID  string
	URL string
}

// Resolver answers which edges have routes matching a topic.
type Resolver interface {
	Route(ctx context.Context, tenant, topic string) ([]Peer, error)
}

// Forwarder sends messages published on this edge to the peers with
// matching routes, one [Link] per peer.
type Forwarder struct {
	Self        string
	Incarnation uint64
	Resolver    Resolver
	// Bound is how long a QoS 1/2 publish waits for its peers before the
	// publisher is closed without an acknowledgement (DESIGN: PUBLISH).
	Bound   time.Duration
	Logger  *slog.Logger
	Metrics *Metrics // nil: not exported

	mu    sync.Mutex
	ctx   context.Context
	links map[string]*Link
	wg    sync.WaitGroup
}

// Run serves the links until ctx ends.
func (f *Forwarder) Run(ctx context.Context) error {
	f.mu.Lock()
	f.ctx = ctx
	f.mu.Unlock()
	<-ctx.Done()
	f.wg.Wait()
	return nil
}

func (f *Forwarder) link(p Peer) (*Link, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ctx == nil || f.ctx.Err() != nil {
		return nil, fmt.Errorf("%w: forwarder not running", ErrPeerGone)
	}
	if f.links == nil {
		f.links = map[string]*Link{}
	}
	l := f.links[p.ID]
	if l == nil || l.isClosed() {
		l = NewLink(f.Self, f.Incarnation, p.ID, p.URL, f.log(), f.Metrics)
		f.links[p.ID] = l
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			_ = l.Run(f.ctx)
		}()
	}
	return l, nil
}

// Forward implements broker.Peers: m is queued on the link of every peer
// with a matching route before it returns, so a publisher's messages reach
// each peer in order; the wait is bounded from this call on.
func (f *Forwarder) Forward(ctx context.Context, m *broker.Message) (func() error, error) {
	tenant, topic, ok := tenancy.TenantOfTopic(m.Topic)
	if !ok {
		return nil, nil
	}
	bound := f.bound()
	deadline := time.Now().Add(bound)
	// No per-message deadline: a cached answer needs none, and the router
	// client bounds its own lookups.
	peers, err := f.Resolver.Route(ctx, tenant, topic)
	if err != nil {
		return nil, fmt.Errorf("resolve routes: %w", err)
	}
	var pm *commonv1.Message
	var waits []<-chan error
	for _, p := range peers {
		if p.ID == f.Self {
			continue
		}
		l, err := f.link(p)
		if err != nil {
			return nil, err
		}
		if pm == nil {
			pm = m.Proto()
		}
		waits = append(waits, l.Send(pm))
	}
	if m.QoS == 0 || len(waits) == 0 {
		return nil, nil // QoS 0 is best effort across edges too
	}
	return func() error { return WaitUntil(ctx, deadline, bound, waits) }, nil
}

func (f *Forwarder) bound() time.Duration {
	if f.Bound <= 0 {
		return 30 * time.Second
	}
	return f.Bound
}

func (f *Forwarder) log() *slog.Logger {
	if f.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return f.Logger
}

var _ broker.Peers = (*Forwarder)(nil)
