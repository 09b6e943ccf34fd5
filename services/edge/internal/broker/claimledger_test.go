package broker

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A claim in flight holds the settled index at what was seen applied when
// it began (its epoch will be greater), whatever later grants say; once
// it ends the index moves to the highest seen.
func TestClaimLedger_InFlightClaimsHoldTheIndex(t *testing.T) {
	var l claimLedger
	require.Zero(t, l.through())
	l.observe(10)
	first := l.begin()
	l.observe(15) // another claim's grant, or a lease renewal
	second := l.begin()
	l.observe(20)
	require.Equal(t, uint64(10), l.through())
	l.end(first)
	require.Equal(t, uint64(15), l.through())
	l.end(second)
	require.Equal(t, uint64(20), l.through())
	l.observe(5) // an older index says nothing new
	require.Equal(t, uint64(20), l.through())

	// Two claims begun at the same index both hold it.
	a, b := l.begin(), l.begin()
	l.observe(30)
	l.end(a)
	require.Equal(t, uint64(20), l.through())
	l.end(b)
	require.Equal(t, uint64(30), l.through())
}

// The report lists the edges of failed takeovers whose sessions this edge
// does not hold, once each.
func TestBroker_ClaimsSettledListsUnfinishedTakeovers(t *testing.T) {
	b := &Broker{sessions: map[string]*session{}}
	b.ObserveIndex(40)
	through, from := b.ClaimsSettled()
	require.Equal(t, uint64(40), through)
	require.Empty(t, from)

	b.setUnfinished("s1", unfinishedTakeover{previous: "edge-b", epoch: 31})
	b.setUnfinished("s2", unfinishedTakeover{previous: "edge-a", epoch: 32})
	b.setUnfinished("s3", unfinishedTakeover{previous: "edge-b", epoch: 33})
	b.setUnfinished("held", unfinishedTakeover{previous: "edge-c", epoch: 34})
	b.sessions["held"] = &session{} // adopted since
	_, from = b.ClaimsSettled()
	require.Equal(t, []string{"edge-a", "edge-b"}, from)

	b.setUnfinished("s2", unfinishedTakeover{})
	_, from = b.ClaimsSettled()
	require.Equal(t, []string{"edge-b"}, from)
}
