package rendezvous

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// Rank agrees with Pick, and removing a node moves only the sessions it
// ranked first; sessions spread over the nodes.
func TestRank(t *testing.T) {
	t.Parallel()
	nodes := []string{"edge-a", "edge-b", "edge-c", "edge-d"}
	first := map[string]int{}
	moved := 0
	for i := range 4000 {
		id := fmt.Sprintf("dev-%d", i)
		r := Rank("acme", id, nodes)
		require.Len(t, r, len(nodes))
		require.Equal(t, nodes[Pick("acme", id, nodes)], r[0])
		first[r[0]]++
		without := Rank("acme", id, []string{"edge-a", "edge-c", "edge-d"})
		if r[0] != "edge-b" {
			require.Equal(t, r[0], without[0], "only edge-b's sessions move")
		} else {
			moved++
			require.Equal(t, r[1], without[0], "to their second choice")
		}
	}
	for _, n := range nodes {
		require.InDelta(t, 1000, first[n], 150, "spread over %s", n)
	}
	require.Equal(t, first["edge-b"], moved)
	require.Equal(t, -1, Pick("acme", "x", nil))
	require.NotEqual(t, Weight("a", "t1", "c"), Weight("a", "t2", "c"), "tenant is part of the key")
}
