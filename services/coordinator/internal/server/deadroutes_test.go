package server

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

func edgeRec(id string, inc uint64, st raftpb.MemberState) *raftpb.MemberRecord {
	return &raftpb.MemberRecord{MemberId: id, Role: raftpb.MemberRole_MEMBER_ROLE_EDGE, Incarnation: inc, State: st}
}

var (
	alive   = raftpb.MemberState_MEMBER_STATE_ALIVE
	expired = raftpb.MemberState_MEMBER_STATE_EXPIRED
	left    = raftpb.MemberState_MEMBER_STATE_LEFT
)

// TestDeadRoutes_GraceAfterAdoption: nothing is due before custody found the
// dead incarnation's sessions all adopted, and then only after the grace.
func TestDeadRoutes_GraceAfterAdoption(t *testing.T) {
	const grace = 5 * time.Second
	t0 := time.Unix(1_000_000, 0)
	d := newDeadRoutes(grace)
	d.add("edge-a", 3)
	require.Equal(t, 1, d.len())
	require.Empty(t, d.takeDue(t0.Add(time.Hour)), "not adopted yet")
	_, ok := d.next()
	require.False(t, ok)

	// A scan of a state from before the death says nothing about inc 3.
	d.adopted(edgeRec("edge-a", 3, alive), t0)
	d.adopted(edgeRec("edge-a", 2, expired), t0)
	require.Empty(t, d.takeDue(t0.Add(time.Hour)))

	d.adopted(edgeRec("edge-a", 3, expired), t0)
	select {
	case <-d.wake:
	default:
		t.Fatal("adoption did not wake the removal loop")
	}
	at, ok := d.next()
	require.True(t, ok)
	require.Equal(t, t0.Add(grace), at)
	require.Empty(t, d.takeDue(t0.Add(grace-time.Millisecond)))
	// A later scan does not push the grace back.
	d.adopted(edgeRec("edge-a", 3, expired), t0.Add(time.Second))
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(grace)))

	d.done("edge-a", 3)
	require.Zero(t, d.len())
	// The same death seen again (a later event, a replayed scan) is no new work.
	d.add("edge-a", 3)
	d.add("edge-a", 1)
	require.Zero(t, d.len())
}

// TestDeadRoutes_Rejoin: an incarnation that died with a newer one alive is
// adopted once no dead incarnation's session is left, and its removal names
// the dead incarnation, never the live one.
func TestDeadRoutes_Rejoin(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	d := newDeadRoutes(time.Second)
	d.add("edge-a", 3)
	d.adopted(edgeRec("edge-a", 4, alive), t0)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 3}}, d.takeDue(t0.Add(time.Second)))
	d.done("edge-a", 3)
	require.Zero(t, d.len())
}

// TestDeadRoutes_NewerDeathSupersedes: a newer dead incarnation replaces an
// older pending one (its removal covers both), must be adopted afresh, and a
// removal of the older one finishing meanwhile leaves it pending.
func TestDeadRoutes_NewerDeathSupersedes(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	d := newDeadRoutes(time.Second)
	d.add("edge-a", 3)
	d.adopted(edgeRec("edge-a", 3, expired), t0)
	require.Len(t, d.takeDue(t0.Add(time.Second)), 1)

	d.add("edge-a", 5) // inc 4 joined and left while the call for 3 was in flight
	d.done("edge-a", 3)
	require.Equal(t, 1, d.len())
	require.Empty(t, d.takeDue(t0.Add(time.Hour)), "inc 5 is not adopted yet")
	d.adopted(edgeRec("edge-a", 5, left), t0.Add(2*time.Second))
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 5}}, d.takeDue(t0.Add(3*time.Second)))
	// A failure of the older call is not charged to the newer entry.
	require.Zero(t, d.failed("edge-a", 3, t0))
	require.Len(t, d.takeDue(t0.Add(3*time.Second)), 1)
}

// TestDeadRoutes_Backoff: failed calls are retried with doubling waits up to
// the cap.
func TestDeadRoutes_Backoff(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	d := newDeadRoutes(0)
	d.add("edge-a", 1)
	d.add("edge-b", 1)
	d.adopted(edgeRec("edge-a", 1, expired), t0)
	d.adopted(edgeRec("edge-b", 1, expired), t0)
	require.Equal(t, []deadRoute{{edge: "edge-a", inc: 1}, {edge: "edge-b", inc: 1}}, d.takeDue(t0))

	now := t0
	want := removeBackoffMin
	for attempt := 1; attempt <= 10; attempt++ {
		wait := d.failed("edge-a", 1, now)
		require.Equal(t, min(want, removeBackoffMax), wait, "attempt %d", attempt)
		require.Equal(t, []deadRoute{{edge: "edge-b", inc: 1}}, d.takeDue(now.Add(wait-time.Millisecond)))
		now = now.Add(wait)
		require.Equal(t, []deadRoute{{edge: "edge-a", inc: 1, attempts: attempt}, {edge: "edge-b", inc: 1}}, d.takeDue(now))
		want *= 2
	}
	d.done("edge-a", 1)
	d.done("edge-b", 1)
	require.Zero(t, d.len())
}

// TestLeaderTerm_ObserveDeadEdges: the FSM's member events make an edge
// pending for route removal when it expires or leaves, and when it rejoins
// under a new incarnation before the old one expired; other roles and a
// first join do not.
func TestLeaderTerm_ObserveDeadEdges(t *testing.T) {
	term := &leaderTerm{kick: make(chan struct{}, 1), dirty: map[string]uint64{}, incs: map[string]uint64{"known": 7},
		routes: newDeadRoutes(time.Second)}
	member := func(r *raftpb.MemberRecord) fsm.Event { return fsm.Event{Kind: fsm.EventMember, Member: r} }
	router := &raftpb.MemberRecord{MemberId: "r1", Role: raftpb.MemberRole_MEMBER_ROLE_ROUTER, Incarnation: 1, State: expired}

	term.observe(10, []fsm.Event{member(edgeRec("fresh", 1, alive)), member(router)})
	require.Zero(t, term.routes.len(), "a first join and a router leave nothing behind")
	require.Equal(t, map[string]uint64{"fresh": 10}, term.dirty)

	term.observe(11, []fsm.Event{member(edgeRec("fresh", 1, expired))})
	term.observe(12, []fsm.Event{member(edgeRec("known", 9, alive))})
	term.observe(13, []fsm.Event{member(edgeRec("gone", 4, left))})
	require.Equal(t, map[string]uint64{"fresh": 11, "known": 12, "gone": 13}, term.dirty)
	now := time.Unix(1_000_000, 0)
	term.routes.adopted(edgeRec("fresh", 1, expired), now)
	term.routes.adopted(edgeRec("known", 9, alive), now)
	term.routes.adopted(edgeRec("gone", 4, left), now)
	require.Equal(t, []deadRoute{{edge: "fresh", inc: 1}, {edge: "gone", inc: 4}, {edge: "known", inc: 7}},
		term.routes.takeDue(now.Add(time.Second)))

	// The rejoin after an expiry: the expired incarnation is already pending.
	term.observe(14, []fsm.Event{member(edgeRec("fresh", 2, alive))})
	require.Equal(t, 3, term.routes.len())
	term.routes.done("fresh", 1)
	term.observe(15, []fsm.Event{member(edgeRec("fresh", 3, alive))})
	require.Equal(t, []deadRoute{{edge: "gone", inc: 4}, {edge: "known", inc: 7}}, term.routes.takeDue(now.Add(time.Second)))
	require.Equal(t, []deadRoute{{edge: "fresh", inc: 2}}, pendingOnly(term.routes, "fresh"),
		"a rejoin after the expired incarnation's removal makes the one in between pending")
}

// pendingOnly returns the entries of d not yet adopted, for edges.
func pendingOnly(d *deadRoutes, edges ...string) []deadRoute {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []deadRoute
	for _, e := range edges {
		if p := d.pending[e]; p != nil && !p.adopted {
			out = append(out, deadRoute{edge: e, inc: p.inc})
		}
	}
	return out
}
