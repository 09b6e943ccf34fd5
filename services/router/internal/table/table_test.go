package table

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSet_Apply(t *testing.T) {
	t.Parallel()
	r := Route{Filter: "a/+", Group: ""}
	var s Set
	res := s.Apply(Delta{Edge: "e1", Inc: 1, Seq: 1, Op: OpAdd, Route: r, Count: 1})
	require.Equal(t, Result{Changed: true, Added: true, NewRoute: true}, res)
	// Replay: ignored.
	require.Equal(t, Result{}, s.Apply(Delta{Edge: "e1", Inc: 1, Seq: 1, Op: OpAdd, Route: r}))
	// Second edge on the same route: both kept.
	res = s.Apply(Delta{Edge: "e2", Inc: 7, Seq: 3, Op: OpAdd, Route: r})
	require.True(t, res.Added)
	require.False(t, res.NewRoute)
	require.Len(t, s.Routes[r], 2)
	// A late remove from an older incarnation is ignored.
	require.Equal(t, Result{}, s.Apply(Delta{Edge: "e2", Inc: 6, Seq: 99, Op: OpRemove, Route: r}))
	// Count update by the same incarnation: changed, not added.
	res = s.Apply(Delta{Edge: "e2", Inc: 7, Seq: 4, Op: OpAdd, Route: r, Count: 5})
	require.Equal(t, Result{Changed: true}, res)
	require.Equal(t, Result{Changed: true, Removed: true}, s.Apply(Delta{Edge: "e1", Inc: 1, Seq: 2, Op: OpRemove, Route: r}))
	require.Equal(t, Result{}, s.Apply(Delta{Edge: "e1", Inc: 1, Seq: 3, Op: OpRemove, Route: r}))
	require.Equal(t, Result{Changed: true, Removed: true}, s.Apply(Delta{Edge: "e2", Inc: 7, Seq: 5, Op: OpRemove, Route: r}))
	require.Zero(t, s.Len())
}

func TestSet_MarshalRoundTrip(t *testing.T) {
	t.Parallel()
	var s Set
	s.Apply(Delta{Edge: "e1", Inc: 1, Seq: 1, Op: OpAdd, Route: Route{Filter: "a/b"}, Count: 2})
	s.Apply(Delta{Edge: "e2", Inc: 2, Seq: 9, Op: OpAdd, Route: Route{Filter: "a/#", Group: "g"}})
	b, err := s.Marshal()
	require.NoError(t, err)
	got, err := Unmarshal(b)
	require.NoError(t, err)
	require.Equal(t, s.Version, got.Version)
	require.Equal(t, s.Routes, got.Routes)
	b2, err := got.Marshal()
	require.NoError(t, err)
	require.Equal(t, b, b2)
	_, err = Unmarshal([]byte("{garbage"))
	require.Error(t, err)
}
