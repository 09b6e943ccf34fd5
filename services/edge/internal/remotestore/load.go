package remotestore

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	"github.com/keelmq/keel/libs/topic"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// LoadSession reads what is stored for one session, after every write
// submitted before the call was answered (as the local store reads after
// its commits). ok is false when no session record is stored. Queue entries
// come in queue order, numbered by the service's queue sequence; in-flight
// entries in their likely send order (see orderInflight). Entries whose
// message is gone (expired) are skipped, as the local store skips them.
func (s *Store) LoadSession(ctx context.Context, id string) (st durable.SessionState, ok bool, err error) {
	key, err := sessionKey(id)
	if err != nil {
		return st, false, fmt.Errorf("load session: %w", err)
	}
	if err := s.barrier(ctx); err != nil {
		return st, false, fmt.Errorf("load session %q: %w", id, err)
	}
	resp, err := s.client.LoadSession(ctx, connect.NewRequest(&persistencev1.LoadSessionRequest{Session: key}))
	if err != nil {
		return st, false, fmt.Errorf("load session %q: %w", id, rpcError(err))
	}
	r := resp.Msg
	if r.GetSession() == nil {
		return st, false, nil
	}
	tenant := key.GetTenant()
	sc, err := s.codec.scope(tenant)
	if err != nil {
		return st, false, fmt.Errorf("load session %q: %w", id, err)
	}
	if st.Session, err = s.codec.sessionIn(id, r.GetSession()); err != nil {
		return st, false, fmt.Errorf("load session: %w", err)
	}
	msgs := make(map[string]*durable.Message, len(r.GetMessages()))
	for _, pm := range r.GetMessages() {
		if pm.GetTenant() != "" && pm.GetTenant() != tenant {
			continue // never another tenant's, whatever the service holds
		}
		m, err := s.codec.messageIn(pm, tenant)
		if err != nil {
			return st, false, fmt.Errorf("load session %q: %w", id, err)
		}
		msgs[m.ID] = m
	}
	for _, sub := range r.GetSubscriptions() {
		st.Subs = append(st.Subs, subscriptionIn(sc, sub))
	}
	join := func(from []*persistencev1.Entry) []durable.Entry {
		var out []durable.Entry
		for _, pe := range from {
			e := entryIn(pe)
			if e.Msg = msgs[e.MsgID]; e.Msg != nil {
				out = append(out, e)
			}
		}
		return out
	}
	st.Queue = join(r.GetQueue())
	st.Inflight = join(r.GetInflight())
	orderInflight(st.Inflight)
	for _, in := range r.GetIncoming() {
		st.Incoming = append(st.Incoming, durable.Incoming{PacketID: uint16(in.GetPacketId()), MsgID: msgIDString(in.GetMsgId()),
			Unconfirmed: in.GetUnconfirmed(), Fingerprint: in.GetFingerprint()})
	}
	for _, id := range r.GetTookQos2() {
		st.TookQoS2 = append(st.TookQoS2, msgIDString(id))
	}
	return st, true, nil
}

// ImportSession stores a session taken over from another edge, under the
// epoch this edge activated for it, and waits. It adds to what is stored
// rather than replacing it: the store is the state the previous owner wrote
// until it was fenced, so anything there and not in st (a message it queued
// after reading st) was acknowledged to a publisher and must stay. Every
// write is idempotent, so importing twice stores the same.
//
// In-flight entries go first, appended and moved under their packet IDs
// (with their PUBREL state), and the queue after them: a message both in
// flight and queued (two matching subscriptions) then keeps both.
func (s *Store) ImportSession(ctx context.Context, st durable.SessionState) error {
	id := st.Session.ID
	t, err := s.fenced(id)
	if err != nil {
		return fmt.Errorf("import session: %w", err)
	}
	rec, err := s.codec.sessionRecord(&st.Session)
	if err != nil {
		return fmt.Errorf("import session: %w", err)
	}
	b := opBuilder{t: t, c: &s.codec}
	b.ops = append(b.ops, t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutSession{PutSession: &persistencev1.PutSessionOp{Session: rec}}}))
	for i := range st.Subs {
		ps, err := s.codec.subscription(t.key.GetTenant(), &st.Subs[i])
		if err != nil {
			return fmt.Errorf("import session %q: %w", id, err)
		}
		b.ops = append(b.ops, t.with(&persistencev1.WriteOp{Op: &persistencev1.WriteOp_PutSubscription{PutSubscription: &persistencev1.PutSubscriptionOp{Subscription: ps}}}))
	}
	for _, step := range []func(*durable.Entry) error{b.append, b.send} {
		for i := range st.Inflight {
			if e := &st.Inflight[i]; e.QoS > 0 {
				if err := step(e); err != nil {
					return fmt.Errorf("import session %q: in flight: %w", id, err)
				}
			}
		}
	}
	for i := range st.Queue {
		if err := b.append(&st.Queue[i]); err != nil {
			return fmt.Errorf("import session %q: queue: %w", id, err)
		}
	}
	b.flush()
	for _, in := range st.Incoming {
		w, err := incomingOp(t, in)
		if err != nil {
			return fmt.Errorf("import session %q: %w", id, err)
		}
		b.ops = append(b.ops, w)
	}
	return s.do(ctx, true, "import session", id, b.ops...)
}

// MatchRetained returns the retained messages matching a filter (internal
// form), through the service's index of the filter's tenant.
func (s *Store) MatchRetained(ctx context.Context, filter string) ([]durable.Message, error) {
	if s.isClosing() {
		return nil, ErrClosed
	}
	// A shared filter's retained messages are its inner filter's; the
	// internal form names the tenant either way.
	tenant, outside, ok := tenancy.TenantOfTopic(filter)
	if !ok || !tenancy.ValidTenant(tenant) {
		return nil, fmt.Errorf("match retained: %w: %.80q is not an internal filter", ErrInvalid, filter)
	}
	if err := topic.ValidateFilter(outside, topic.Limits{}); err != nil {
		return nil, fmt.Errorf("match retained: %w: filter %.80q: %v", ErrInvalid, outside, err)
	}
	resp, err := s.client.LookupRetained(ctx, connect.NewRequest(&persistencev1.LookupRetainedRequest{
		Tenant: tenant, Filter: outside, Limit: s.cfg.MaxRetained}))
	if err != nil {
		return nil, fmt.Errorf("match retained %q: %w", filter, rpcError(err))
	}
	out := make([]durable.Message, 0, len(resp.Msg.GetMessages()))
	for _, pm := range resp.Msg.GetMessages() {
		if pm.GetTenant() != "" && pm.GetTenant() != tenant {
			continue
		}
		m, err := s.codec.messageIn(pm, tenant)
		if err != nil {
			return nil, fmt.Errorf("match retained %q: %w", filter, err)
		}
		out = append(out, *m)
	}
	return out, nil
}

// rpcError classifies a failed unary call: refused as malformed, or not
// answered (worth a retry).
func rpcError(err error) error {
	switch connect.CodeOf(err) {
	case connect.CodeInvalidArgument:
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	case connect.CodeCanceled, connect.CodeDeadlineExceeded:
		return err
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}
