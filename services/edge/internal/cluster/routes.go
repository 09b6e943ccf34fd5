package cluster

import (
	"context"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/routerclient"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	"github.com/keelmq/keel/services/edge/internal/forward"
)

// Routes registers the edge's filters at the router through its client.
type Routes struct{ Client *routerclient.Client }

// Add implements the broker's Routes: it returns once the route is durable
// and every contrary cache entry is gone (the SUBACK may leave then).
func (r Routes) Add(ctx context.Context, tenant, filter, group string) error {
	return r.Client.Subscribe(ctx, tenant, shareForm(filter, group))
}

// Remove implements the broker's Routes.
func (r Routes) Remove(ctx context.Context, tenant, filter, group string) error {
	return r.Client.Unsubscribe(ctx, tenant, shareForm(filter, group))
}

func shareForm(filter, group string) string {
	if group == "" {
		return filter
	}
	return "$share/" + group + "/" + filter
}

// Peers maps edge IDs to their edge API URLs from the coordinator's
// membership, refreshed every interval.
type Peers struct {
	Client   coordinatorv1connect.CoordinatorServiceClient
	Interval time.Duration

	mu   sync.RWMutex
	urls map[string]string
}

// Run refreshes the membership until ctx ends.
func (p *Peers) Run(ctx context.Context) error {
	for {
		p.refresh(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(max(p.Interval, 100*time.Millisecond)):
		}
	}
}

func (p *Peers) refresh(ctx context.Context) { _ = p.Refresh(ctx) }

// Refresh reads the membership from the coordinator now. After it returns
// nil, an edge missing from URL is not a live member: its lease expired.
func (p *Peers) Refresh(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	resp, err := p.Client.Status(cctx, connect.NewRequest(&coordinatorv1.StatusRequest{}))
	if err != nil {
		return err
	}
	urls := map[string]string{}
	for _, m := range resp.Msg.GetMembers() {
		if m.GetRole() == coordinatorv1.MemberRole_MEMBER_ROLE_EDGE && m.GetAddress() != "" &&
			(m.GetState() == coordinatorv1.MemberState_MEMBER_STATE_ALIVE || m.GetState() == coordinatorv1.MemberState_MEMBER_STATE_DRAINING) {
			urls[m.GetMemberId()] = "http://" + m.GetAddress()
		}
	}
	p.mu.Lock()
	p.urls = urls
	p.mu.Unlock()
	return nil
}

// IDs lists the live edges known, this one included.
func (p *Peers) IDs() []string {
	p.mu.RLock()
	defer p.mu.RUnlock()
	ids := make([]string, 0, len(p.urls))
	for id := range p.urls {
		ids = append(ids, id)
	}
	return ids
}

// URL returns the edge API URL of an edge, if it is a live member.
func (p *Peers) URL(edgeID string) (string, bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	u, ok := p.urls[edgeID]
	return u, ok
}

// Resolver answers which peers must receive a publish: the router's
// matching edges, with their addresses from the membership. For a shared
// group it names every edge with a member; each picks one of its members
// (cross-edge group semantics come with the cluster data plane).
type Resolver struct {
	Self   string
	Routes *routerclient.Client
	Peers  *Peers
}

// Route implements forward.Resolver.
func (r Resolver) Route(ctx context.Context, tenant, topic string) ([]forward.Peer, error) {
	res, err := r.Routes.Route(ctx, tenant, topic)
	if err != nil {
		return nil, err
	}
	ids := map[string]bool{}
	for _, e := range res.Edges {
		ids[e] = true
	}
	for _, g := range res.Groups {
		for _, e := range g.Edges {
			ids[e] = true
		}
	}
	var out []forward.Peer
	var unknown []string
	for id := range ids {
		if u, ok := r.Peers.URL(id); ok {
			out = append(out, forward.Peer{ID: id, URL: u})
		} else if id != r.Self {
			unknown = append(unknown, id)
		}
	}
	if len(unknown) > 0 {
		// A route names an edge this one has not heard of yet (it just
		// joined): ask the coordinator now rather than drop its share.
		r.Peers.refresh(ctx)
		for _, id := range unknown {
			u, ok := r.Peers.URL(id)
			if !ok {
				return nil, fmt.Errorf("%w: route to unknown edge %q", forward.ErrPeerGone, id)
			}
			out = append(out, forward.Peer{ID: id, URL: u})
		}
	}
	return out, nil
}
