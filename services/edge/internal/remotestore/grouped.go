package remotestore

import (
	"context"
	"errors"
	"fmt"

	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/services/edge/internal/durable"
	"github.com/keelmq/keel/services/edge/internal/tenancy"
)

// Grouped is the edge's durable state over K Redis groups: one Store (one
// Write stream) per group's persistence service, a session's ops sent to
// its group by the cluster's slot table, a tenant's retained messages to
// the group of the tenant's slot. Sessions never span groups, so every
// guarantee of a Store (order, fencing, acknowledgement) holds per session
// as it does with one group.
type Grouped struct {
	stores []*Store
	slots  slots.Table
}

// NewGrouped returns the durable state over one store per group, in group
// order, mapped by table (nil: one group).
func NewGrouped(stores []*Store, table slots.Table) (*Grouped, error) {
	if len(stores) == 0 {
		return nil, errors.New("no persistence store")
	}
	if len(stores) > 1 || table != nil {
		if err := table.Validate(len(stores)); err != nil {
			return nil, fmt.Errorf("%d persistence URLs: %w", len(stores), err)
		}
	}
	return &Grouped{stores: stores, slots: table}, nil
}

// of returns the store of the session id (internal client ID). An ID that
// is not one goes to the first store, which refuses it.
func (g *Grouped) of(id string) *Store {
	tenant, clientID, ok := tenancy.TenantOfClientID(id)
	if !ok {
		return g.stores[0]
	}
	return g.stores[g.slots.Session(tenant, clientID)]
}

// ofTopic returns the store of the retained messages of a topic or filter
// (internal form): its tenant's group. One that is not in internal form
// goes to the first store, which refuses it.
func (g *Grouped) ofTopic(name string) *Store {
	tenant, _, ok := tenancy.TenantOfTopic(name)
	if !ok {
		return g.stores[0]
	}
	return g.stores[g.slots.Tenant(tenant)]
}

// Close closes every group's store.
func (g *Grouped) Close() error {
	errs := make([]error, len(g.stores))
	for i, s := range g.stores {
		errs[i] = s.Close()
	}
	return errors.Join(errs...)
}

// Load returns nothing, as [Store.Load].
func (g *Grouped) Load() ([]durable.SessionState, []durable.Message, error) { return nil, nil, nil }

// Shared is true: every edge reads and writes the same state.
func (g *Grouped) Shared() bool { return true }

func (g *Grouped) Activate(ctx context.Context, id string, epoch uint64) error {
	return g.of(id).Activate(ctx, id, epoch)
}

func (g *Grouped) Deactivate(id string, epoch uint64) { g.of(id).Deactivate(id, epoch) }

func (g *Grouped) PutSession(ctx context.Context, rec durable.Session) error {
	return g.of(rec.ID).PutSession(ctx, rec)
}

func (g *Grouped) DeleteSession(ctx context.Context, id string, wait bool) error {
	return g.of(id).DeleteSession(ctx, id, wait)
}

func (g *Grouped) PutSubscription(ctx context.Context, id string, sub durable.Subscription) error {
	return g.of(id).PutSubscription(ctx, id, sub)
}

func (g *Grouped) DeleteSubscription(ctx context.Context, id, filter string) error {
	return g.of(id).DeleteSubscription(ctx, id, filter)
}

func (g *Grouped) Enqueue(id string, e durable.Entry) *durable.Pending {
	return g.of(id).Enqueue(id, e)
}

func (g *Grouped) Dequeue(ctx context.Context, id string, gone []durable.Entry) error {
	return g.of(id).Dequeue(ctx, id, gone)
}

func (g *Grouped) Send(id string, entries []durable.Entry) *durable.Pending {
	return g.of(id).Send(id, entries)
}

func (g *Grouped) Pubrel(ctx context.Context, id string, packetID uint16) error {
	return g.of(id).Pubrel(ctx, id, packetID)
}

func (g *Grouped) Complete(ctx context.Context, id string, packetID uint16) error {
	return g.of(id).Complete(ctx, id, packetID)
}

func (g *Grouped) PutIncoming(ctx context.Context, id string, in durable.Incoming) error {
	return g.of(id).PutIncoming(ctx, id, in)
}

func (g *Grouped) DeleteIncoming(ctx context.Context, id string, packetID uint16) error {
	return g.of(id).DeleteIncoming(ctx, id, packetID)
}

func (g *Grouped) PutRetained(ctx context.Context, m *durable.Message, wait bool) error {
	return g.ofTopic(m.Topic).PutRetained(ctx, m, wait)
}

func (g *Grouped) LoadSession(ctx context.Context, id string) (durable.SessionState, bool, error) {
	return g.of(id).LoadSession(ctx, id)
}

func (g *Grouped) ImportSession(ctx context.Context, st durable.SessionState) error {
	return g.of(st.Session.ID).ImportSession(ctx, st)
}

// MatchRetained looks up filter (internal form) in the group of its
// tenant.
func (g *Grouped) MatchRetained(ctx context.Context, filter string) ([]durable.Message, error) {
	return g.ofTopic(filter).MatchRetained(ctx, filter)
}
