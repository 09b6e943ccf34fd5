package cluster

import (
	"context"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/routerclient"
	"github.com/keelmq/keel/services/edge/internal/forward"
)

// TestResolver_UnsettledGoesToEveryEdge: an answer the router gave while
// settling a membership change names every live edge (it may have missed
// one), says so (each edge then serves its own group members), and keeps
// the shared groups it knows for a message routed again.
func TestResolver_UnsettledGoesToEveryEdge(t *testing.T) {
	p := &Peers{urls: map[string]string{"e1": "http://e1", "e2": "http://e2", "e3": "http://e3"},
		incs: map[string]uint64{"e1": 1, "e2": 2, "e3": 3}}
	r := Resolver{Self: "e1", Peers: p}
	ids := func(ps []forward.Peer) []string {
		var out []string
		for _, p := range ps {
			out = append(out, p.ID)
		}
		slices.Sort(out)
		return out
	}
	got, err := r.peers(context.Background(), routerclient.Result{Edges: []string{"e2"}}, false)
	require.NoError(t, err)
	require.Equal(t, []string{"e2"}, ids(got.Edges))

	got, err = r.peers(context.Background(), routerclient.Result{Edges: []string{"e2"}, All: true,
		Groups: []routerclient.Group{{Name: "g", Filter: "a/#", Edges: []string{"e3"}}}}, false)
	require.NoError(t, err)
	require.Equal(t, []string{"e1", "e2", "e3"}, ids(got.Edges))
	require.True(t, got.Unsettled)
	require.Len(t, got.Groups, 1)
	require.Equal(t, []string{"e3"}, ids(got.Groups[0].Edges))
	require.EqualValues(t, 3, got.Edges[slices.IndexFunc(got.Edges, func(p forward.Peer) bool { return p.ID == "e3" })].Incarnation)
}

// TestResolver_GroupOfLeftEdgesFailsUnsettledToo: a group whose every named
// edge left fails the route even in an unsettled answer. Every live edge
// would serve its own members, but the left edges' members are on none of
// them until their sessions are adopted, and no edge that took the message
// would owe the group: the publish waits for the routes instead.
func TestResolver_GroupOfLeftEdgesFailsUnsettledToo(t *testing.T) {
	t.Parallel()
	r := Resolver{Self: "edge-a", Peers: &Peers{Client: joinedEdgeA(t).Client}}
	for _, all := range []bool{false, true} {
		_, err := r.peers(t.Context(), routerclient.Result{All: all,
			Groups: []routerclient.Group{{Name: "g", Filter: "a/#", Edges: []string{"edge-gone"}}}}, true)
		require.ErrorIs(t, err, forward.ErrPeerLeft, "unsettled: %v", all)
	}
	got, err := r.peers(t.Context(), routerclient.Result{All: true,
		Groups: []routerclient.Group{{Name: "g", Filter: "a/#", Edges: []string{"edge-gone", "edge-a"}}}}, true)
	require.NoError(t, err, "a group with a live edge left is served")
	require.Len(t, got.Groups, 1)
}
