package forward

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/rendezvous"
	"github.com/keelmq/keel/libs/rpc"
	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/proto/gen/keel/edge/v1/edgev1connect"
	"github.com/keelmq/keel/services/edge/internal/broker"
)

// SessionHandover is the local side of a takeover: the broker.
type SessionHandover interface {
	TakeOver(ctx context.Context, tenant, clientID, newOwner string, newEpoch uint64, cleanStart bool) (owned, wasConnected bool, state []byte, err error)
	TakeoverEnd(ctx context.Context, tenant, clientID string, newEpoch uint64) ([]byte, error)
}

// TakeoverBegin implements edgev1connect.EdgeServiceHandler.
func (s *Server) TakeoverBegin(ctx context.Context, req *connect.Request[edgev1.TakeoverBeginRequest]) (*connect.Response[edgev1.TakeoverBeginResponse], error) {
	if s.Sessions == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this edge hands no sessions over"))
	}
	k := req.Msg.GetSession()
	if k.GetTenant() == "" || k.GetClientId() == "" || req.Msg.GetNewEpoch() == 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("takeover needs session.tenant, session.client_id and new_epoch"))
	}
	if req.Msg.GetNewOwnerEdgeId() != "" {
		if err := s.vet(ctx, req.Msg.GetNewOwnerEdgeId(), req.Msg.GetNewOwnerIncarnation()); err != nil {
			return nil, err
		}
	}
	owned, connected, state, err := s.Sessions.TakeOver(ctx, k.GetTenant(), k.GetClientId(), req.Msg.GetNewOwnerEdgeId(), req.Msg.GetNewEpoch(), req.Msg.GetCleanStart())
	if held := (*broker.HeldElsewhereError)(nil); errors.As(err, &held) {
		return connect.NewResponse(&edgev1.TakeoverBeginResponse{HeldBy: held.Edge}), nil
	}
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&edgev1.TakeoverBeginResponse{Owned: owned, WasConnected: connected, SessionState: state}), nil
}

// TakeoverEnd implements edgev1connect.EdgeServiceHandler.
func (s *Server) TakeoverEnd(ctx context.Context, req *connect.Request[edgev1.TakeoverEndRequest]) (*connect.Response[edgev1.TakeoverEndResponse], error) {
	if s.Sessions == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this edge hands no sessions over"))
	}
	k := req.Msg.GetSession()
	if k.GetTenant() == "" || k.GetClientId() == "" || req.Msg.GetNewEpoch() == 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("takeover needs session.tenant, session.client_id and new_epoch"))
	}
	late, err := s.Sessions.TakeoverEnd(ctx, k.GetTenant(), k.GetClientId(), req.Msg.GetNewEpoch())
	if err != nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, err)
	}
	return connect.NewResponse(&edgev1.TakeoverEndResponse{LateState: late, FramesLanding: s.framesLanding()}), nil
}

// URLs finds a peer edge's API URL by its ID.
type URLs interface {
	URL(edgeID string) (string, bool)
}

// Takeovers calls TakeoverBegin on the previous owner of a claimed session.
type Takeovers struct {
	Self        string
	Incarnation func() uint64 // this edge's current one
	Peers       URLs

	mu      sync.Mutex
	clients map[string]edgev1connect.EdgeServiceClient // by URL
}

// Begin implements broker.Takeover.
func (t *Takeovers) Begin(ctx context.Context, previousOwner, tenant, clientID string, newEpoch uint64, cleanStart bool) ([]byte, error) {
	c, err := t.peer(ctx, previousOwner)
	if err != nil {
		return nil, err
	}
	resp, err := c.TakeoverBegin(ctx, connect.NewRequest(&edgev1.TakeoverBeginRequest{
		Session:  &commonv1.SessionKey{Tenant: tenant, ClientId: clientID},
		NewEpoch: newEpoch, NewOwnerEdgeId: t.Self, NewOwnerIncarnation: t.Incarnation(), CleanStart: cleanStart,
	}))
	if err != nil {
		return nil, err
	}
	if held := resp.Msg.GetHeldBy(); held != "" {
		return nil, &broker.HeldElsewhereError{Edge: held}
	}
	return resp.Msg.GetSessionState(), nil
}

// End implements broker.Takeover.
func (t *Takeovers) End(ctx context.Context, previousOwner, tenant, clientID string, newEpoch uint64) (broker.TakeoverEnded, error) {
	c, err := t.peer(ctx, previousOwner)
	if err != nil {
		return broker.TakeoverEnded{}, err
	}
	resp, err := c.TakeoverEnd(ctx, connect.NewRequest(&edgev1.TakeoverEndRequest{
		Session: &commonv1.SessionKey{Tenant: tenant, ClientId: clientID}, NewEpoch: newEpoch,
	}))
	if err != nil {
		return broker.TakeoverEnded{}, err
	}
	return broker.TakeoverEnded{Late: resp.Msg.GetLateState(), FramesLanding: resp.Msg.GetFramesLanding()}, nil
}

// ErrNotMember means the edge is not a live member by the coordinator's
// current membership: its lease expired, so it has fenced itself and
// closed its connections, and there is nothing to take over from it.
var ErrNotMember = broker.ErrPreviousOwnerGone

// Refresher rereads the membership (cluster.Peers).
type Refresher interface {
	Refresh(ctx context.Context) error
}

func (t *Takeovers) peer(ctx context.Context, id string) (edgev1connect.EdgeServiceClient, error) {
	url, ok := t.Peers.URL(id)
	if !ok {
		// The copy of the membership may predate the edge's join: ask
		// again before concluding it is gone.
		if r, can := t.Peers.(Refresher); can {
			if err := r.Refresh(ctx); err != nil {
				return nil, fmt.Errorf("membership unknown: %w", err)
			}
			url, ok = t.Peers.URL(id)
		}
		if !ok {
			return nil, fmt.Errorf("edge %q: %w", id, ErrNotMember)
		}
	}
	return t.client(url), nil
}

func (t *Takeovers) client(url string) edgev1connect.EdgeServiceClient {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.clients == nil {
		t.clients = map[string]edgev1connect.EdgeServiceClient{}
	}
	c := t.clients[url]
	if c == nil {
		c = edgev1connect.NewEdgeServiceClient(rpc.H2CClient(), url, rpc.ClientOptions(connect.WithGRPC())...)
		t.clients[url] = c
	}
	return c
}

var _ broker.Takeover = (*Takeovers)(nil)

// Adopt implements edgev1connect.EdgeServiceHandler.
func (s *Server) Adopt(ctx context.Context, req *connect.Request[edgev1.AdoptRequest]) (*connect.Response[edgev1.AdoptResponse], error) {
	if s.Custodian == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this edge adopts no sessions"))
	}
	k := req.Msg.GetSession()
	if k.GetTenant() == "" || k.GetClientId() == "" || req.Msg.GetFromEdgeId() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("adopt needs session.tenant, session.client_id and from_edge_id"))
	}
	adopted, err := s.Custodian.Adopt(ctx, k.GetTenant(), k.GetClientId(), req.Msg.GetFromEdgeId())
	if err != nil {
		return nil, connect.NewError(connect.CodeUnavailable, err)
	}
	return connect.NewResponse(&edgev1.AdoptResponse{Adopted: adopted}), nil
}

// Custodian is the local side of an adoption: the broker.
type Custodian interface {
	Adopt(ctx context.Context, tenant, clientID, fromEdge string) (bool, error)
}

// Members lists the live peer edges and their API URLs.
type Members interface {
	URLs
	IDs() []string
}

// Custody hands the sessions of this (draining) edge to custodians: the
// live peer edge ranked first for the session by rendezvous hashing, and the
// next ones if it fails, so that handovers spread evenly and a session goes
// where the coordinator would send it.
type Custody struct {
	Self  string
	Peers Members
	// Calls reuses the clients of the takeover path.
	Calls *Takeovers
}

// Handover implements broker.Custody.
func (c *Custody) Handover(ctx context.Context, tenant, clientID string) error {
	var errs []error
	for _, id := range custodians(c.Self, c.Peers.IDs(), tenant, clientID) {
		cl, err := c.Calls.peer(ctx, id)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		resp, err := cl.Adopt(ctx, connect.NewRequest(&edgev1.AdoptRequest{
			Session: &commonv1.SessionKey{Tenant: tenant, ClientId: clientID}, FromEdgeId: c.Self}))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", id, err))
			continue
		}
		if !resp.Msg.GetAdopted() {
			return fmt.Errorf("%s did not adopt the session", id)
		}
		return nil
	}
	if len(errs) == 0 {
		return errors.New("no other live edge to hand the session to")
	}
	return errors.Join(errs...)
}

// custodians orders the candidate edges for a session as the coordinator
// does when it reassigns sessions (libs/rendezvous), leaving out this edge.
func custodians(self string, ids []string, tenant, clientID string) []string {
	return slices.DeleteFunc(rendezvous.Rank(tenant, clientID, ids), func(id string) bool { return id == self })
}

var _ broker.Custody = (*Custody)(nil)
