package store

import (
	"context"
	"fmt"
)

// OpKind names a write: each kind is one [Store] method.
type OpKind uint8

// The write kinds, one per [Store] write method.
const (
	OpActivate OpKind = iota + 1
	OpPutSession
	OpDeleteSession
	OpPutSubscription
	OpDeleteSubscription
	OpAppend
	OpSend
	OpPubrel
	OpComplete
	OpDequeue
	OpPutIncoming
	OpDeleteIncoming
	OpPutRetained
)

var opNames = [...]string{"", "activate", "put_session", "delete_session", "put_subscription", "delete_subscription",
	"append", "send", "pubrel", "complete", "dequeue", "put_incoming", "delete_incoming", "put_retained"}

// String returns the kind's snake-case name (also its metric label).
func (k OpKind) String() string {
	if int(k) < len(opNames) && k != 0 {
		return opNames[k]
	}
	return fmt.Sprintf("op(%d)", k)
}

// OpKinds lists every kind, for metrics.
func OpKinds() []OpKind {
	out := make([]OpKind, 0, len(opNames)-1)
	for k := OpActivate; k <= OpPutRetained; k++ {
		out = append(out, k)
	}
	return out
}

// Op is one write of a batch, holding the arguments of the [Store] method
// its Kind names; fields the method does not take are ignored.
type Op struct {
	Kind  OpKind
	Key   SessionKey
	Fence Fence

	Session   Session      // PutSession
	Sub       Subscription // PutSubscription
	Filter    string       // DeleteSubscription
	Limits    QueueLimits  // Append
	Entries   []Entry      // Append, Send
	Messages  []*Message   // Append
	PacketID  uint16       // Pubrel, DeleteIncoming
	PacketIDs []uint16     // Complete
	MsgIDs    []string     // Dequeue
	Incoming  Incoming     // PutIncoming
	Tenant    string       // PutRetained
	Retained  *Message     // PutRetained
}

// Records is how many records the op writes, for batch-size metrics.
func (o *Op) Records() int {
	switch o.Kind {
	case OpAppend, OpSend:
		return len(o.Entries)
	case OpComplete:
		return len(o.PacketIDs)
	case OpDequeue:
		return len(o.MsgIDs)
	}
	return 1
}

// OpResult is the outcome of one [Op].
type OpResult struct {
	Err     error
	Append  AppendResult // Append
	Changed bool         // PutRetained
}

// Batcher is implemented by stores that commit many ops together. Submit
// queues ops behind every op submitted before, and returns a function that
// waits for their results (one per op, in order). A session's ops (and a
// retained topic's) are applied in the order they were submitted, within a
// call and across calls; ops of different sessions may be applied in any
// order, as each session has a single writer and each op is answered by
// itself.
type Batcher interface {
	Submit(ctx context.Context, ops []Op) (wait func() []OpResult)
}

// Submit hands ops to s in order: through [Batcher] when s implements it,
// or else by applying them one after the other now.
func Submit(ctx context.Context, s Store, ops []Op) (wait func() []OpResult) {
	if b, ok := s.(Batcher); ok {
		return b.Submit(ctx, ops)
	}
	res := make([]OpResult, len(ops))
	for i := range ops {
		res[i] = Apply(ctx, s, &ops[i])
	}
	return func() []OpResult { return res }
}

// Apply runs one op through the [Store] method its kind names.
func Apply(ctx context.Context, s Store, o *Op) OpResult {
	var r OpResult
	switch o.Kind {
	case OpActivate:
		r.Err = s.Activate(ctx, o.Key, o.Fence)
	case OpPutSession:
		r.Err = s.PutSession(ctx, o.Key, o.Fence, o.Session)
	case OpDeleteSession:
		r.Err = s.DeleteSession(ctx, o.Key, o.Fence)
	case OpPutSubscription:
		r.Err = s.PutSubscription(ctx, o.Key, o.Fence, o.Sub)
	case OpDeleteSubscription:
		r.Err = s.DeleteSubscription(ctx, o.Key, o.Fence, o.Filter)
	case OpAppend:
		r.Append, r.Err = s.Append(ctx, o.Key, o.Fence, o.Limits, o.Entries, o.Messages)
	case OpSend:
		r.Err = s.Send(ctx, o.Key, o.Fence, o.Entries)
	case OpPubrel:
		r.Err = s.Pubrel(ctx, o.Key, o.Fence, o.PacketID)
	case OpComplete:
		r.Err = s.Complete(ctx, o.Key, o.Fence, o.PacketIDs)
	case OpDequeue:
		r.Err = s.Dequeue(ctx, o.Key, o.Fence, o.MsgIDs)
	case OpPutIncoming:
		r.Err = s.PutIncoming(ctx, o.Key, o.Fence, o.Incoming)
	case OpDeleteIncoming:
		r.Err = s.DeleteIncoming(ctx, o.Key, o.Fence, o.PacketID)
	case OpPutRetained:
		r.Changed, r.Err = s.PutRetained(ctx, o.Tenant, o.Retained)
	default:
		r.Err = fmt.Errorf("%w: unknown op kind %d", ErrInvalid, o.Kind)
	}
	return r
}
