package cluster

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/routerclient"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
	"github.com/keelmq/keel/proto/gen/keel/coordinator/v1/coordinatorv1connect"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/forward"
)

// Routes registers the edge's filters at the router through its client.
type Routes struct{ Client *routerclient.Client }

// Add implements the broker's Routes: it returns once the route is durable
// and every contrary cache entry is gone (the SUBACK may leave then).
func (r Routes) Add(ctx context.Context, tenant, filter, group string) error {
	err := r.Client.Subscribe(ctx, tenant, shareForm(filter, group))
	if errors.Is(err, routerclient.ErrRejected) {
		return fmt.Errorf("%w: %w", broker.ErrRouteRefused, err)
	}
	return err
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
	// OnGone, if set, hears of every edge that left the membership (its
	// lease expired, or it came back under a new incarnation) at the
	// refresh that noticed it; called without locks held.
	OnGone func(edgeID string)

	mu   sync.RWMutex
	urls map[string]string
	incs map[string]uint64 // incarnation of each live edge
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
	urls, incs := map[string]string{}, map[string]uint64{}
	for _, m := range resp.Msg.GetMembers() {
		if m.GetRole() == coordinatorv1.MemberRole_MEMBER_ROLE_EDGE && m.GetAddress() != "" &&
			(m.GetState() == coordinatorv1.MemberState_MEMBER_STATE_ALIVE || m.GetState() == coordinatorv1.MemberState_MEMBER_STATE_DRAINING) {
			urls[m.GetMemberId()] = "http://" + m.GetAddress()
			incs[m.GetMemberId()] = m.GetIncarnation()
		}
	}
	p.mu.Lock()
	var gone []string
	for id, inc := range p.incs {
		if now, ok := incs[id]; !ok || now != inc {
			gone = append(gone, id)
		}
	}
	p.urls, p.incs = urls, incs
	p.mu.Unlock()
	if p.OnGone != nil {
		for _, id := range gone {
			p.OnGone(id)
		}
	}
	return nil
}

// Incarnation returns the incarnation of a live edge.
func (p *Peers) Incarnation(edgeID string) (uint64, bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	inc, ok := p.incs[edgeID]
	return inc, ok
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

// peer returns a live edge as a forwarding destination: its URL and
// incarnation, read together.
func (p *Peers) peer(id string) (forward.Peer, bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	u, ok := p.urls[id]
	return forward.Peer{ID: id, URL: u, Incarnation: p.incs[id]}, ok
}

// URL returns the edge API URL of an edge, if it is a live member.
func (p *Peers) URL(edgeID string) (string, bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	u, ok := p.urls[edgeID]
	return u, ok
}

// Resolver answers which peers must receive a publish: the router's
// matching edges, with their addresses from the membership, and for each
// matching shared group the edges with members (the forwarder picks one).
type Resolver struct {
	Self   string
	Routes *routerclient.Client
	Peers  *Peers
}

// RouteAtOnce implements forward.LocalResolver: held is false when the
// router must be asked, or the membership read again for an edge a route
// names.
func (r Resolver) RouteAtOnce(tenant, topic string) (forward.Route, bool, error) {
	res, held, err := r.Routes.RouteAtOnce(tenant, topic)
	if err != nil || !held {
		return forward.Route{}, false, err
	}
	out, err := r.peers(context.Background(), res, false)
	if errors.Is(err, errNeedsRefresh) {
		return forward.Route{}, false, nil
	}
	return out, err == nil, err
}

// Route implements forward.Resolver.
func (r Resolver) Route(ctx context.Context, tenant, topic string) (forward.Route, error) {
	res, err := r.Routes.Route(ctx, tenant, topic)
	if err != nil {
		return forward.Route{}, err
	}
	return r.peers(ctx, res, true)
}

// errNeedsRefresh: a route names an edge unknown here, and reading the
// membership again was not allowed.
var errNeedsRefresh = errors.New("membership needs a refresh")

// peers gives the edges of res their addresses and incarnations. An edge
// not known here is looked up in the membership again if mayRefresh, or
// else the answer is errNeedsRefresh.
func (r Resolver) peers(ctx context.Context, res routerclient.Result, mayRefresh bool) (forward.Route, error) {
	refreshed := false
	peer := func(id string) (forward.Peer, error) {
		if p, ok := r.Peers.peer(id); ok {
			return p, nil
		}
		if id == r.Self {
			return forward.Peer{ID: id}, nil
		}
		if !mayRefresh {
			return forward.Peer{}, errNeedsRefresh
		}
		if !refreshed {
			// A route names an edge this one has not heard of yet (it just
			// joined): ask the coordinator now rather than drop its share.
			refreshed = true
			r.Peers.refresh(ctx)
			if p, ok := r.Peers.peer(id); ok {
				return p, nil
			}
		}
		return forward.Peer{}, fmt.Errorf("%w: route to unknown edge %q", forward.ErrPeerLeft, id)
	}
	var out forward.Route
	out.Unsettled = res.All
	ids := res.Edges
	if res.All {
		// The router is settling a membership change: its answer may miss
		// an edge, so every live edge gets the message (each delivers to its
		// own matching subscribers only).
		ids = r.Peers.IDs()
		for _, id := range res.Edges {
			if !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
	}
	for _, id := range ids {
		p, err := peer(id)
		if err != nil {
			return forward.Route{}, err
		}
		out.Edges = append(out.Edges, p)
	}
	for _, g := range res.Groups {
		// One member takes a group's message: an edge that left (its routes
		// outlive it until its sessions are adopted) is passed over while
		// another has members. Only a group with none live fails the publish.
		gr := forward.GroupRoute{Name: g.Name, Filter: g.Filter}
		var gone error
		for _, id := range g.Edges {
			p, err := peer(id)
			if errors.Is(err, errNeedsRefresh) {
				return forward.Route{}, err
			}
			if err != nil {
				gone = err
				continue
			}
			gr.Edges = append(gr.Edges, p)
		}
		if len(gr.Edges) == 0 && gone != nil {
			// Unsettled too: every live edge then serves its own members,
			// but the left edges' members are on none of them until their
			// sessions are adopted, and the group would be owed by no edge
			// that took the message.
			return forward.Route{}, gone
		}
		if len(gr.Edges) > 0 {
			out.Groups = append(out.Groups, gr)
		}
	}
	return out, nil
}
