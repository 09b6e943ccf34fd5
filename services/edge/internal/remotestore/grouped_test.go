package remotestore

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/slots"
	"github.com/keelmq/keel/services/edge/internal/broker"
	"github.com/keelmq/keel/services/edge/internal/durable"
)

var (
	_ broker.DurableState  = (*Grouped)(nil)
	_ broker.RetainedIndex = (*Grouped)(nil)
)

// Two Redis groups, each behind its own persistence service: every
// session's state goes to the group its slot maps to, and only there, and
// comes back through the grouped store; so do a tenant's retained messages.
func TestGrouped_SessionsAndRetainedByGroup(t *testing.T) {
	t.Parallel()
	table := slots.Even(2)
	groups := []*Store{
		newStore(t, startPersistence(t, startRedis(t)).URL),
		newStore(t, startPersistence(t, startRedis(t)).URL),
	}
	g, err := NewGrouped(groups, table)
	require.NoError(t, err)
	ctx := ctxT(t)
	sc := scope(t, "acme")

	const sessions = 24
	in := [2]int{}
	for i := range sessions {
		id := sc.ClientID(fmt.Sprintf("device-%d", i))
		require.NoError(t, g.Activate(ctx, id, 3))
		require.NoError(t, g.PutSession(ctx, durable.Session{ID: id, Listener: "tcp", ProtocolVersion: 5, ExpiryInterval: 3600}))
		m := message(sc, uint64(i+1), fmt.Sprintf("devices/%d", i), 1)
		require.NoError(t, g.Enqueue(id, queued(m, 1, 1)).Wait(ctx))
		in[table.Session("acme", fmt.Sprintf("device-%d", i))]++
	}
	require.NotZero(t, in[0], "no session of group 0: choose other IDs")
	require.NotZero(t, in[1], "no session of group 1: choose other IDs")
	for i := range sessions {
		id := sc.ClientID(fmt.Sprintf("device-%d", i))
		own := table.Session("acme", fmt.Sprintf("device-%d", i))
		st, ok, err := g.LoadSession(ctx, id)
		require.NoError(t, err)
		require.True(t, ok, "session %d", i)
		require.Len(t, st.Queue, 1, "session %d", i)
		_, there, err := groups[1-own].LoadSession(ctx, id)
		require.NoError(t, err)
		require.False(t, there, "session %d of group %d is in group %d too", i, own, 1-own)
	}

	// Retained messages go by tenant: find two tenants of different groups.
	var tenants [2]string
	for i := 0; tenants[0] == "" || tenants[1] == ""; i++ {
		name := fmt.Sprintf("tenant-%d", i)
		tenants[table.Tenant(name)] = name
	}
	for grp, tenant := range tenants {
		ts := scope(t, tenant)
		m := message(ts, 100+uint64(grp), "status", 1)
		m.Retain = true
		require.NoError(t, g.PutRetained(ctx, m, true))
		got, err := g.MatchRetained(ctx, ts.Topic("#"))
		require.NoError(t, err)
		require.Len(t, got, 1, "tenant %s", tenant)
		other, err := groups[1-grp].MatchRetained(ctx, ts.Topic("#"))
		require.NoError(t, err)
		require.Empty(t, other, "tenant %s of group %d has retained messages in group %d", tenant, grp, 1-grp)
	}
}

func TestNewGrouped_TableMustFit(t *testing.T) {
	_, err := NewGrouped(nil, nil)
	require.Error(t, err)
	s := &Store{}
	_, err = NewGrouped([]*Store{s, s}, slots.Even(3))
	require.ErrorIs(t, err, slots.ErrInvalid)
	_, err = NewGrouped([]*Store{s, s}, nil)
	require.ErrorIs(t, err, slots.ErrInvalid)
	_, err = NewGrouped([]*Store{s}, nil)
	require.NoError(t, err)
}
