package server

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/services/persistence/internal/failover"
	"github.com/keelmq/keel/services/persistence/internal/store"

	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// ErrStopping is returned for batches that arrive while the server stops.
var ErrStopping = errors.New("persistence instance stopping")

// classify is the one mapping from the store's sentinels to what callers
// see: a Connect code for unary RPCs and stream errors, a [persistencev1.WriteStatus]
// for ops and batches. Anything not recognised may not have happened and is
// worth a retry: Unavailable.
func classify(err error) (connect.Code, persistencev1.WriteStatus) {
	switch {
	case err == nil:
		return 0, persistencev1.WriteStatus_WRITE_STATUS_OK
	case errors.Is(err, store.ErrInvalid):
		return connect.CodeInvalidArgument, persistencev1.WriteStatus_WRITE_STATUS_INVALID_ARGUMENT
	case errors.Is(err, store.ErrFenced):
		return connect.CodeFailedPrecondition, persistencev1.WriteStatus_WRITE_STATUS_FENCED
	case errors.Is(err, store.ErrGroupFenced):
		return connect.CodeFailedPrecondition, persistencev1.WriteStatus_WRITE_STATUS_GROUP_FENCED
	case errors.Is(err, store.ErrNotReplicated):
		// Applied on the primary, not confirmed by a replica: the caller
		// must not acknowledge. Retrying is safe (ops are idempotent).
		return connect.CodeUnavailable, persistencev1.WriteStatus_WRITE_STATUS_NOT_REPLICATED
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled, persistencev1.WriteStatus_WRITE_STATUS_UNAVAILABLE
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded, persistencev1.WriteStatus_WRITE_STATUS_UNAVAILABLE
	}
	return connect.CodeUnavailable, persistencev1.WriteStatus_WRITE_STATUS_UNAVAILABLE
}

// toConnect turns a store error into a Connect error.
func toConnect(err error) error {
	if err == nil {
		return nil
	}
	code, _ := classify(err)
	return connect.NewError(code, err)
}

// switchoverError maps a switchover's failure to its Connect code. Unknown
// means the outcome is not known (the record's compare-and-set got no
// answer): read the group record.
func switchoverError(err error) error {
	code := connect.CodeInternal
	switch {
	case errors.Is(err, failover.ErrBadTarget):
		code = connect.CodeInvalidArgument
	case errors.Is(err, failover.ErrNotInSync), errors.Is(err, failover.ErrNoCandidate),
		errors.Is(err, failover.ErrPrimaryNotServing), errors.Is(err, failover.ErrUnsupported):
		code = connect.CodeFailedPrecondition
	case errors.Is(err, failover.ErrLeaseHeld), errors.Is(err, failover.ErrPromotionRunning),
		errors.Is(err, failover.ErrRecordChanged):
		code = connect.CodeAborted
	case errors.Is(err, failover.ErrOutcomeUnknown):
		code = connect.CodeUnknown
	case errors.Is(err, failover.ErrCoordinator):
		code = connect.CodeUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		code = connect.CodeDeadlineExceeded
	}
	return connect.NewError(code, err)
}
