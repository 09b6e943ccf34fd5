package server

import (
	"time"

	"github.com/keelmq/keel/libs/routes"
)

// Bloom sizing. A tenant's filter is sized for bloomHeadroom times the
// anchors it holds at a false-positive rate of bloomFP, and rebuilt at that
// size once it holds more than half of what it was sized for, so an edge
// probing three anchors per publish sees well under 1 % false positives.
const (
	bloomFP       = 0.01
	bloomMin      = 1024
	bloomHeadroom = 4
)

// bloomState is one tenant's anchor Bloom filter on a router node, with the
// anchors it was built from, so it can be rebuilt larger.
//
// NOTE(router): anchors are never removed: the filter only says "may exist",
// so a stale anchor costs a Lookup, never a lost route. The set costs about
// 60 bytes per anchor on every router node.
type bloomState struct {
	bloom    *routes.Bloom
	version  uint64
	capacity int // anchors the filter was sized for
	anchors  map[string]struct{}
}

func newBloomState(capacity int, prev uint64) *bloomState {
	capacity = max(bloomMin, capacity)
	return &bloomState{bloom: routes.NewBloom(capacity, bloomFP), capacity: capacity,
		version: max(uint64(time.Now().UnixNano()), prev+1), anchors: map[string]struct{}{}}
}

// addAnchorsLocked adds anchors to tenant's filter, creating or rebuilding it
// as needed. It returns the filter, whether it is new (created or rebuilt:
// edges must be sent all of it) and how many anchors were not in it yet.
//
// n.mu must be held.
func (n *Node) addAnchorsLocked(tenant string, anchors []string) (bs *bloomState, fresh bool, added int) {
	bs = n.blooms[tenant]
	fresh = bs == nil
	if bs == nil {
		bs = newBloomState(bloomHeadroom*len(anchors), 0)
		n.blooms[tenant] = bs
	}
	for _, a := range anchors {
		if _, ok := bs.anchors[a]; ok {
			continue
		}
		bs.anchors[a] = struct{}{}
		bs.bloom.Add(a)
		added++
	}
	if len(bs.anchors) > bs.capacity/2 {
		nb := newBloomState(bloomHeadroom*len(bs.anchors), bs.version)
		nb.anchors = bs.anchors
		for a := range nb.anchors {
			nb.bloom.Add(a)
		}
		n.blooms[tenant] = nb
		n.m.bloomRebuilds.Inc()
		return nb, true, added
	}
	return bs, fresh, added
}
