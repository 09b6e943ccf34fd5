package lease

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

func TestTable_RenewAndExpire(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	tb := NewTable(10 * time.Second)
	tb.Grant(Lease{MemberID: "e1", Role: raftpb.MemberRole_MEMBER_ROLE_EDGE, Incarnation: 1, State: raftpb.MemberState_MEMBER_STATE_ALIVE}, now)

	_, ok := tb.Renew("e1", 2, now.Add(time.Second))
	require.False(t, ok, "wrong incarnation")
	_, ok = tb.Renew("e1", 1, now.Add(9*time.Second))
	require.True(t, ok)
	require.Empty(t, tb.Expired(now.Add(18*time.Second)))
	require.Len(t, tb.Expired(now.Add(19*time.Second)), 1)
	_, ok = tb.Renew("e1", 1, now.Add(19*time.Second))
	require.False(t, ok, "an expired lease cannot be renewed")
	require.Zero(t, tb.Remaining("e1", 1, now.Add(20*time.Second)))
}

func TestTable_Reset_GrantsFullTTL(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	tb := NewTable(10 * time.Second)
	tb.Reset([]*raftpb.MemberRecord{
		{MemberId: "a", Incarnation: 1, State: raftpb.MemberState_MEMBER_STATE_ALIVE, Role: raftpb.MemberRole_MEMBER_ROLE_EDGE},
		{MemberId: "b", Incarnation: 1, State: raftpb.MemberState_MEMBER_STATE_EXPIRED, Role: raftpb.MemberRole_MEMBER_ROLE_EDGE},
	}, now)
	_, ok := tb.Get("b")
	require.False(t, ok)
	require.Equal(t, 10*time.Second, tb.Remaining("a", 1, now))
	require.Len(t, tb.Valid(raftpb.MemberRole_MEMBER_ROLE_EDGE, raftpb.MemberState_MEMBER_STATE_ALIVE, now), 1)
}

func TestCustodian_Stable(t *testing.T) {
	t.Parallel()
	edges := []string{"e1", "e2", "e3", "e4"}
	counts := map[int]int{}
	moved := 0
	for i := range 4000 {
		c := "client-" + strconv.Itoa(i)
		p := Custodian("acme", c, edges)
		counts[p]++
		// Removing e4 moves only e4's sessions.
		q := Custodian("acme", c, edges[:3])
		if p != 3 {
			require.Equal(t, p, q)
		} else {
			moved++
		}
	}
	for i := range edges {
		require.InDelta(t, 1000, counts[i], 200, "edge %d", i)
	}
	require.Equal(t, counts[3], moved)
	require.Equal(t, -1, Custodian("acme", "c", nil))
}
