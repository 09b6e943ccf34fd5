package broker

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// The ring against a slice doing the same: pushes, pops, inserts and
// removals anywhere, and filtered removals, across growth and wrap-around
// of its buffer. Every delivery in it carries a message, and comes out in
// the order the slice has.
func TestRing_MatchesSlice(t *testing.T) {
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 7))
		var r ring
		var want []uint64
		next := uint64(1)
		check := func(op string) {
			t.Helper()
			if r.len() != len(want) {
				t.Fatalf("seed %d after %s: len %d, want %d", seed, op, r.len(), len(want))
			}
			for i, seq := range want {
				if d := r.at(i); d.msg == nil || d.seq != seq {
					t.Fatalf("seed %d after %s: at %d holds seq %d (msg %v), want %d", seed, op, i, d.seq, d.msg != nil, seq)
				}
			}
		}
		for range 2000 {
			switch op := rng.IntN(10); {
			case op < 4:
				r.push(delivery{msg: &Message{}, seq: next})
				want = append(want, next)
				next++
				check("push")
			case op < 6 && len(want) > 0:
				d := r.pop()
				if d.seq != want[0] || d.msg == nil {
					t.Fatalf("seed %d: pop gave seq %d, want %d", seed, d.seq, want[0])
				}
				want = want[1:]
				check("pop")
			case op < 7:
				i := rng.IntN(len(want) + 1)
				r.insert(i, delivery{msg: &Message{}, seq: next})
				want = slices.Insert(want, i, next)
				next++
				check("insert")
			case op < 8 && len(want) > 0:
				i := rng.IntN(len(want))
				r.remove(i)
				want = slices.Delete(want, i, i+1)
				check("remove")
			case op < 9:
				mod := uint64(rng.IntN(5) + 2)
				r.removeIf(func(d *delivery) bool { return d.seq%mod == 0 })
				want = slices.DeleteFunc(want, func(seq uint64) bool { return seq%mod == 0 })
				check("removeIf")
			}
		}
	}
}
