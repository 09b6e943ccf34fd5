package server

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/routes"
	"github.com/keelmq/keel/libs/topic"
	"github.com/keelmq/keel/services/router/internal/store"
)

// ErrInvalid reports input from outside that the router refuses; nothing of
// the request is stored.
var ErrInvalid = errors.New("router: invalid request")

// ErrStaleIncarnation reports a stream from an edge incarnation older than one
// the router has seen.
var ErrStaleIncarnation = errors.New("router: stale edge incarnation")

// ErrWildcardCap reports a wildcard-first filter over the per-tenant cap.
var ErrWildcardCap = errors.New("router: wildcard-first filter cap reached")

// ErrNoOwner reports that no live router node could be found for a key.
var ErrNoOwner = errors.New("router: no owner for route key")

// ErrSlowEdge reports an edge whose stream did not keep up.
var ErrSlowEdge = errors.New("router: edge stream too slow")

// ErrOtherView refuses a notification made under another router membership
// view than the receiver's (the sender retries).
var ErrOtherView = errors.New("router: request under another membership view")

// ErrLoading refuses edge streams and lookups until the node has loaded its
// replicas (wildcard-first routes, Bloom filters, dead edges) from the
// store: what it would send or answer before then lacks them. Callers retry.
var ErrLoading = errors.New("router: node still loading its replicas")

// ErrRebuilding refuses a lookup while a new table waits for the edges to
// register their routes again (Config.RebuildWait); callers retry.
var ErrRebuilding = errors.New("router: routing table being rebuilt")

// connectError maps an error to a Connect error; the one place that does.
func connectError(err error) error {
	var ce *connect.Error
	switch {
	case err == nil:
		return nil
	case errors.As(err, &ce):
		return err
	case errors.Is(err, ErrInvalid), errors.Is(err, routes.ErrInvalidTenant), errors.Is(err, routes.ErrInvalidGroup),
		errors.Is(err, topic.ErrEmpty), errors.Is(err, topic.ErrTooLong), errors.Is(err, topic.ErrInvalidUTF8),
		errors.Is(err, topic.ErrInvalidWildcard), errors.Is(err, topic.ErrInvalidShare), errors.Is(err, topic.ErrTooManyLevels),
		errors.Is(err, topic.ErrWildcardInName):
		return connect.NewError(connect.CodeInvalidArgument, err)
	case errors.Is(err, ErrStaleIncarnation):
		return connect.NewError(connect.CodeFailedPrecondition, err)
	case errors.Is(err, ErrWildcardCap), errors.Is(err, ErrSlowEdge):
		return connect.NewError(connect.CodeResourceExhausted, err)
	case errors.Is(err, store.ErrNotFound):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, context.Canceled):
		return connect.NewError(connect.CodeCanceled, err)
	case errors.Is(err, context.DeadlineExceeded):
		return connect.NewError(connect.CodeDeadlineExceeded, err)
	default:
		return connect.NewError(connect.CodeUnavailable, err)
	}
}
