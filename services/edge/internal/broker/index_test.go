package broker

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// Overlapping subscriptions of one session merge into one delivery at the
// highest QoS with every subscription identifier, whether few or many
// recipients match (the two merge paths).
func TestIndex_MatchMergesPerSession(t *testing.T) {
	t.Parallel()
	for _, others := range []int{0, 3, smallMerge + 5} {
		t.Run(fmt.Sprintf("others=%d", others), func(t *testing.T) {
			x := newIndex()
			s := &session{id: "s"}
			s.nsubs.Store(3)
			x.add(&subscription{sess: s, filter: "t/a", qos: 0, ids: []int{2}})
			x.add(&subscription{sess: s, filter: "t/+", qos: 2, ids: []int{1}})
			x.add(&subscription{sess: s, filter: "t/#", qos: 1, rap: true})
			for i := range others {
				o := &session{id: fmt.Sprint(i)}
				o.nsubs.Store(int32(1 + i%2)) // some with other subscriptions too
				x.add(&subscription{sess: o, filter: "t/#", qos: 1})
			}
			got := x.match("t/a", nil, nil, false, nil)
			require.Len(t, got, others+1)
			for _, tg := range got {
				if tg.sess == s {
					require.Equal(t, byte(2), tg.qos)
					require.True(t, tg.rap)
					require.Equal(t, []int{1, 2}, tg.ids)
				}
			}
		})
	}
}

func BenchmarkIndex_Match(b *testing.B) {
	for _, subs := range []int{1, 50, 1000} {
		b.Run(fmt.Sprintf("subscribers=%d", subs), func(b *testing.B) {
			x := newIndex()
			for i := range subs {
				x.add(&subscription{sess: &session{id: fmt.Sprint(i)}, filter: "bench/+", qos: 1})
			}
			dst := make([]target, 0, subs)
			b.ReportAllocs()
			for b.Loop() {
				dst = x.match("bench/x", dst[:0], nil, false, nil)
			}
		})
	}
}
