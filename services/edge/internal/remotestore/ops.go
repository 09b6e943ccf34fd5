package remotestore

import (
	"context"
	"fmt"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/services/edge/internal/durable"
)

// The writes of broker.DurableState. Those the local store makes without
// waiting (acknowledgement deletes: Dequeue, Complete, DeleteIncoming) are
// only submitted here too: losing one means a redelivery, never a loss.

// target is the session a write is for, and the fence its writes carry.
type target struct {
	id    string
	key   *commonv1.SessionKey
	fence *persistencev1.Fence
}

// with addresses w to the session.
func (t *target) with(w *persistencev1.WriteOp) *persistencev1.WriteOp {
	w.Session, w.Fence = t.key, t.fence
	return w
}

// PutSession stores the session record and waits for it.
func (s *Store) PutSession(ctx context.Context, rec durable.Session) error {
	t, err := s.fenced(rec.ID)
	if err != nil {
		return fmt.Errorf("put session: %w", err)
	}
	r, err := s.codec.sessionRecord(&rec)
	if err != nil {
		return fmt.Errorf("put session: %w", err)
	}
	return s.do(ctx, true, "put session", t.id,
		t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutSession{PutSession: &persistencev1.PutSessionOp{Session: r}}}))
}

// DeleteSession removes everything of the session but its epoch.
func (s *Store) DeleteSession(ctx context.Context, id string, wait bool) error {
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("delete session: %w", err)
	}
	return s.do(ctx, wait, "delete session", id,
		t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_DeleteSession{DeleteSession: &persistencev1.DeleteSessionOp{}}}))
}

// PutSubscription stores a subscription and waits (it is behind a SUBACK).
func (s *Store) PutSubscription(ctx context.Context, id string, sub durable.Subscription) error {
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("put subscription: %w", err)
	}
	ps, err := s.codec.subscription(t.key.GetTenant(), &sub)
	if err != nil {
		return fmt.Errorf("put subscription: %w", err)
	}
	return s.do(ctx, true, "put subscription", id,
		t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutSubscription{PutSubscription: &persistencev1.PutSubscriptionOp{Subscription: ps}}}))
}

// DeleteSubscription removes a subscription (internal filter) and waits.
func (s *Store) DeleteSubscription(ctx context.Context, id, filter string) error {
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("delete subscription: %w", err)
	}
	sc, err := s.codec.scope(t.key.GetTenant())
	if err != nil {
		return fmt.Errorf("delete subscription: %w", err)
	}
	outside, err := outsideFilter(sc, filter)
	if err != nil {
		return fmt.Errorf("delete subscription: %w", err)
	}
	return s.do(ctx, true, "delete subscription", id,
		t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_DeleteSubscription{DeleteSubscription: &persistencev1.DeleteSubscriptionOp{Filter: outside}}}))
}

// Enqueue appends a message to the session's queue, set-if-absent by
// msgID (a retry is harmless). The edge enforces the session's own bounds;
// an [durable.Entry.Offline] entry is also held to the tenant's queue
// bound, which the service keeps across edges, and fails with
// [durable.ErrQueueQuota] when refused by it. Wait on the result before
// acknowledging the message to its publisher.
func (s *Store) Enqueue(id string, e durable.Entry) *durable.Pending {
	t, err := s.fenced(id)
	if err != nil {
		return durable.DonePending(fmt.Errorf("enqueue: %w", err))
	}
	b := opBuilder{t: t, c: &s.codec}
	if err := b.append(&e); err != nil {
		return durable.DonePending(fmt.Errorf("enqueue: %w", err))
	}
	ws := b.done()
	if e.Offline {
		for _, w := range ws {
			if a := w.GetAppend(); a != nil {
				a.Limits = &persistencev1.QueueLimits{TenantQuota: true}
			}
		}
	}
	return s.start(true, "enqueue", id, ws...)
}

// Dequeue removes queue entries, named by MsgID, without sending them.
func (s *Store) Dequeue(ctx context.Context, id string, gone []durable.Entry) error {
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("dequeue: %w", err)
	}
	var ws []*persistencev1.WriteOp
	for len(gone) > 0 {
		n := min(len(gone), maxOpEntries)
		d := &persistencev1.DequeueOp{MsgIds: make([]*commonv1.MsgID, 0, n)}
		for i := range gone[:n] {
			mid, err := parseMsgID(gone[i].MsgID)
			if err != nil {
				return fmt.Errorf("dequeue: %w", err)
			}
			d.MsgIds = append(d.MsgIds, mid)
		}
		ws = append(ws, t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_Dequeue{Dequeue: d}}))
		gone = gone[n:]
	}
	return s.do(ctx, false, "dequeue", id, ws...)
}

// Send moves entries to the in-flight set under their packet IDs; wait on
// the result before the first send, so the packet IDs are durable. QoS 0
// entries just leave the queue. An entry the edge never queued durably
// (Seq 0: live delivery), or whose queueing the tenant's bound may have
// refused ([durable.Entry.StoreFirst]), has its message appended first, in
// the same call and not held to the bound, because the service moves only
// messages it stores.
func (s *Store) Send(id string, entries []durable.Entry) *durable.Pending {
	t, err := s.fenced(id)
	if err != nil {
		return durable.DonePending(fmt.Errorf("send: %w", err))
	}
	b := opBuilder{t: t, c: &s.codec}
	for i := range entries {
		if e := &entries[i]; (e.Seq == 0 || e.StoreFirst) && e.QoS > 0 {
			if err := b.append(e); err != nil {
				return durable.DonePending(fmt.Errorf("send: %w", err))
			}
		}
	}
	b.flush()
	for i := range entries {
		if e := &entries[i]; e.Seq > 0 || e.QoS > 0 {
			if err := b.send(e); err != nil {
				return durable.DonePending(fmt.Errorf("send: %w", err))
			}
		}
	}
	return s.start(true, "send", id, b.done()...)
}

// Pubrel records PUBREC received for a QoS 2 delivery, before PUBREL
// leaves.
func (s *Store) Pubrel(ctx context.Context, id string, packetID uint16) error {
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("pubrel: %w", err)
	}
	if packetID == 0 {
		return fmt.Errorf("pubrel: %w: packet ID 0", ErrInvalid)
	}
	return s.do(ctx, true, "pubrel", id,
		t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_Pubrel{Pubrel: &persistencev1.PubrelOp{PacketId: uint32(packetID)}}}))
}

// Complete removes an in-flight delivery the client acknowledged.
func (s *Store) Complete(ctx context.Context, id string, packetID uint16) error {
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("complete: %w", err)
	}
	if packetID == 0 {
		return fmt.Errorf("complete: %w: packet ID 0", ErrInvalid)
	}
	return s.do(ctx, false, "complete", id,
		t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_Complete{Complete: &persistencev1.CompleteOp{PacketIds: []uint32{uint32(packetID)}}}}))
}

// PutIncoming records an inbound QoS 2 message before it is routed.
func (s *Store) PutIncoming(ctx context.Context, id string, in durable.Incoming) error {
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("put incoming: %w", err)
	}
	w, err := incomingOp(t, in)
	if err != nil {
		return fmt.Errorf("put incoming: %w", err)
	}
	return s.do(ctx, true, "put incoming", id, w)
}

func incomingOp(t *target, in durable.Incoming) (*persistencev1.WriteOp, error) {
	if in.PacketID == 0 {
		return nil, fmt.Errorf("%w: incoming %s: packet ID 0", ErrInvalid, in.MsgID)
	}
	mid, err := parseMsgID(in.MsgID)
	if err != nil {
		return nil, err
	}
	return t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutIncoming{PutIncoming: &persistencev1.PutIncomingOp{
		Incoming: &persistencev1.Incoming{PacketId: uint32(in.PacketID), MsgId: mid,
			Unconfirmed: in.Unconfirmed, Fingerprint: in.Fingerprint}}}}), nil
}

// DeleteIncoming forgets an inbound QoS 2 message once PUBREL arrived.
func (s *Store) DeleteIncoming(ctx context.Context, id string, packetID uint16) error {
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("delete incoming: %w", err)
	}
	if packetID == 0 {
		return fmt.Errorf("delete incoming: %w: packet ID 0", ErrInvalid)
	}
	// Waits, as the durable store's: the PUBCOMP leaves after it.
	return s.do(ctx, true, "delete incoming", id,
		t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_DeleteIncoming{DeleteIncoming: &persistencev1.DeleteIncomingOp{PacketId: uint32(packetID)}}}))
}

// PutRetained stores (or with an empty payload clears) the retained
// message of its topic, unless a newer one is stored. It carries no fence:
// retained messages belong to no session.
func (s *Store) PutRetained(ctx context.Context, m *durable.Message, wait bool) error {
	pm, err := s.codec.message(m, "")
	if err != nil {
		return fmt.Errorf("put retained: %w", err)
	}
	return s.do(ctx, wait, "put retained", "",
		&persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutRetained{PutRetained: &persistencev1.PutRetainedOp{Message: pm}}})
}

// opBuilder builds a call's queue and in-flight ops within the service's
// limits: at most maxOpEntries entries per op, and no packet ID twice in
// one send (a later entry for the same ID goes into the next op, so it
// replaces the earlier one, as it would in the local store).
type opBuilder struct {
	t   *target
	c   *codec
	ops []*persistencev1.WriteOp
	app *persistencev1.AppendOp
	snd *persistencev1.SendOp
	pks map[uint32]struct{} // packet IDs in snd
}

func (b *opBuilder) append(e *durable.Entry) error {
	pe, err := entry(e, false)
	if err != nil {
		return err
	}
	m, err := b.c.message(e.Msg, b.t.key.GetTenant())
	if err != nil {
		return err
	}
	if e.Msg.ID != e.MsgID {
		return fmt.Errorf("%w: entry %s carries message %s", ErrInvalid, e.MsgID, e.Msg.ID)
	}
	if b.snd != nil || (b.app != nil && len(b.app.Entries) == maxOpEntries) {
		b.flush()
	}
	if b.app == nil {
		b.app = &persistencev1.AppendOp{}
	}
	b.app.Entries = append(b.app.Entries, pe)
	b.app.Messages = append(b.app.Messages, m)
	return nil
}

func (b *opBuilder) send(e *durable.Entry) error {
	pe, err := entry(e, true)
	if err != nil {
		return err
	}
	_, dup := b.pks[pe.GetPacketId()]
	if b.app != nil || (b.snd != nil && (len(b.snd.Entries) == maxOpEntries || dup)) {
		b.flush()
	}
	if b.snd == nil {
		b.snd = &persistencev1.SendOp{}
	}
	if pe.GetQos() > 0 {
		if b.pks == nil {
			b.pks = map[uint32]struct{}{}
		}
		b.pks[pe.GetPacketId()] = struct{}{}
	}
	b.snd.Entries = append(b.snd.Entries, pe)
	return nil
}

// flush closes the op being built.
func (b *opBuilder) flush() {
	if b.app != nil {
		b.ops = append(b.ops, b.t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_Append{Append: b.app}}))
		b.app = nil
	}
	if b.snd != nil {
		b.ops = append(b.ops, b.t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_Send{Send: b.snd}}))
		b.snd = nil
		clear(b.pks)
	}
}

func (b *opBuilder) done() []*persistencev1.WriteOp {
	b.flush()
	return b.ops
}
