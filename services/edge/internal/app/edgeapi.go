package app

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/forward"
	"github.com/keelmq/keel/services/edge/internal/tenancy"

	edgev1 "github.com/keelmq/keel/proto/gen/keel/edge/v1"
	"github.com/keelmq/keel/proto/gen/keel/edge/v1/edgev1connect"
)

// Kicker disconnects clients on an operator's request: the broker.
type Kicker interface {
	Kick(ctx context.Context, tenant, clientID string, discard bool) (broker.KickResult, error)
	ID() (edge string, incarnation uint64)
}

// lifecycle reports an edge's state and drains it: the Edge.
type lifecycle interface {
	status() *edgev1.StatusResponse
	// drain starts the drain on the first call (deadline 0: the edge's
	// default; serverReference "": the configured one) and reports its
	// progress on every call.
	drain(deadline time.Duration, serverReference string) *edgev1.DrainResponse
}

// edgeAPI is the edge's cluster API (edgev1connect.EdgeServiceHandler): the
// embedded forward.Server serves what edges call on each other (Forward,
// the takeover, Adopt), edgeAPI the operator calls (keelctl).
type edgeAPI struct {
	*forward.Server
	Kicker Kicker
	// Kicks counts KickSession calls by outcome (kickCounter); nil: none.
	Kicks *prometheus.CounterVec
	// Life serves Status and Drain; nil: Unimplemented.
	Life lifecycle
}

// kickCounter registers keel_edge_session_kicks_total with reg, or returns
// the one registered already.
func kickCounter(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "keel_edge_session_kicks_total",
		Help: "KickSession calls (keelctl session kick) by outcome: disconnected (the session stays), disconnected_ended (and the session ended), " +
			"ended (an offline session discarded), offline (nothing to do), not_found (this edge holds no such session), error.",
	}, []string{"outcome"})
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(*prometheus.CounterVec); ok {
				return existing
			}
		}
		return c // counted, not exported
	}
	return c
}

func (a *edgeAPI) count(outcome string) {
	if a.Kicks != nil {
		a.Kicks.WithLabelValues(outcome).Inc()
	}
}

// kickOutcome is the metric label of a kick that succeeded.
func kickOutcome(r broker.KickResult) string {
	switch {
	case r.WasConnected && r.Discarded:
		return "disconnected_ended"
	case r.WasConnected:
		return "disconnected"
	case r.Discarded:
		return "ended"
	}
	return "offline"
}

var _ edgev1connect.EdgeServiceHandler = (*edgeAPI)(nil)

// Handler returns the HTTP handler of the edge API.
func (a *edgeAPI) Handler() (string, http.Handler) {
	return edgev1connect.NewEdgeServiceHandler(a, forward.HandlerOptions()...)
}

// KickSession implements edgev1connect.EdgeServiceHandler.
func (a *edgeAPI) KickSession(ctx context.Context, req *connect.Request[edgev1.KickSessionRequest]) (*connect.Response[edgev1.KickSessionResponse], error) {
	if a.Kicker == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this edge kicks no sessions"))
	}
	k := req.Msg.GetSession()
	tenant, clientID := k.GetTenant(), k.GetClientId()
	switch {
	case tenant == "" || clientID == "":
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("kick needs session.tenant and session.client_id"))
	case !tenancy.ValidTenant(tenant):
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%w: %q: want [a-z0-9-]{1,63}", tenancy.ErrInvalidTenant, truncate(tenant)))
	}
	res, err := a.Kicker.Kick(ctx, tenant, clientID, req.Msg.GetDiscard())
	if err != nil {
		edge, _ := a.Kicker.ID()
		code := connect.CodeInternal
		outcome := "error"
		switch {
		case errors.Is(err, broker.ErrNoSession):
			code, outcome = connect.CodeNotFound, "not_found"
		case errors.Is(err, broker.ErrKickRaced):
			code = connect.CodeAborted
		case errors.Is(err, broker.ErrStopping):
			code = connect.CodeUnavailable
		case errors.Is(err, tenancy.ErrInvalidTenant):
			code = connect.CodeInvalidArgument
		case errors.Is(err, context.DeadlineExceeded):
			code = connect.CodeDeadlineExceeded
		case errors.Is(err, context.Canceled):
			code = connect.CodeCanceled
		}
		a.count(outcome)
		return nil, connect.NewError(code, fmt.Errorf("edge %s, session %s/%s: %w", edge, tenant, truncate(clientID), err))
	}
	a.count(kickOutcome(res))
	return connect.NewResponse(&edgev1.KickSessionResponse{WasConnected: res.WasConnected,
		ProtocolVersion: uint32(res.ProtocolVersion), Discarded: res.Discarded}), nil
}

// Status implements edgev1connect.EdgeServiceHandler.
func (a *edgeAPI) Status(context.Context, *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.StatusResponse], error) {
	if a.Life == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this edge reports no status"))
	}
	return connect.NewResponse(a.Life.status()), nil
}

// Drain implements edgev1connect.EdgeServiceHandler: the first call starts
// the drain in the background and every call reports its progress, until
// DRAINED. The drained edge stays up, not ready and admitting nobody, until
// it is stopped.
func (a *edgeAPI) Drain(_ context.Context, req *connect.Request[edgev1.DrainRequest]) (*connect.Response[edgev1.DrainResponse], error) {
	if a.Life == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this edge does not drain on request"))
	}
	var deadline time.Duration
	if d := req.Msg.GetDeadline(); d != nil {
		if err := d.CheckValid(); err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("deadline: %w", err))
		}
		if deadline = d.AsDuration(); deadline < 0 {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("deadline %v: want 0 (the edge's default) or more", deadline))
		}
	}
	ref := req.Msg.GetServerReference()
	if err := validServerReference(ref); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("server_reference: %w", err))
	}
	return connect.NewResponse(a.Life.drain(deadline, ref)), nil
}

// truncate bounds a caller-supplied string quoted in an error.
func truncate(s string) string {
	const maxLen = 64
	if len(s) > maxLen {
		return s[:maxLen] + "..."
	}
	return s
}
