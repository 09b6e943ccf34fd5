package server

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftnode"

	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// ErrLeaseInvalid is returned when the caller's lease is expired or its
// incarnation unknown; the member must fence itself and rejoin.
var ErrLeaseInvalid = errors.New("lease invalid")

// ErrNoLeader is returned when no leader is known, or it cannot be reached.
var ErrNoLeader = errors.New("no known leader")

// ErrNotReady is returned by a new leader until it has applied every entry of
// earlier terms (its barrier) and rebuilt its lease table.
var ErrNotReady = errors.New("leader not ready")

// ErrForwardLoop is returned when a forwarded request reaches a node that is
// not the leader either (the leader changed in flight); the client retries.
var ErrForwardLoop = errors.New("forwarded request reached a follower")

func invalid(format string, args ...any) error {
	return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%w: "+format, append([]any{fsm.ErrInvalidArgument}, args...)...))
}

// toConnect maps a sentinel to its Connect code. It is the one place where
// this service turns errors into codes.
func (s *Server) toConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	var code connect.Code
	switch {
	case errors.Is(err, fsm.ErrInvalidArgument):
		code = connect.CodeInvalidArgument
	case errors.Is(err, fsm.ErrStaleEpoch), errors.Is(err, fsm.ErrNotOwner),
		errors.Is(err, fsm.ErrStaleIncarnation), errors.Is(err, ErrLeaseInvalid):
		code = connect.CodeFailedPrecondition
	case errors.Is(err, raftnode.ErrNotLeader), errors.Is(err, ErrNoLeader), errors.Is(err, ErrForwardLoop):
		return s.notLeader(err)
	case errors.Is(err, raftnode.ErrUnknownOutcome), errors.Is(err, ErrNotReady):
		code = connect.CodeUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		code = connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = connect.CodeCanceled
	default:
		code = connect.CodeInternal
	}
	return connect.NewError(code, err)
}

// notLeader returns Unavailable with a NotLeaderDetail naming the leader.
func (s *Server) notLeader(err error) error {
	ce := connect.NewError(connect.CodeUnavailable, err)
	id, _ := s.node.Leader()
	d := &coordinatorv1.NotLeaderDetail{LeaderId: id, LeaderAddress: s.apiURL(id)}
	if det, derr := connect.NewErrorDetail(d); derr == nil {
		ce.AddDetail(det)
	}
	return ce
}
