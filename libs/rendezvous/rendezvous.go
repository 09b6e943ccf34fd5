// Package rendezvous ranks nodes for a session by rendezvous (highest random
// weight) hashing of tenant and client ID: every process ranks the same
// candidates the same way, and when a candidate leaves only the sessions it
// ranked first move. The coordinator picks custodians of a dead edge's
// sessions with it, and a draining edge its sessions' custodians, so both
// agree on where a session goes.
package rendezvous

import (
	"hash/fnv"
	"slices"
)

// Weight is node's weight for the session (tenant, clientID).
func Weight(node, tenant, clientID string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(node))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(tenant))
	_, _ = h.Write([]byte{0})
	_, _ = h.Write([]byte(clientID))
	return mix(h.Sum64())
}

// Pick returns the index of the candidate with the highest weight, or -1
// for no candidates.
func Pick(tenant, clientID string, candidates []string) int {
	best, bestW := -1, uint64(0)
	for i, c := range candidates {
		if w := Weight(c, tenant, clientID); best < 0 || w > bestW {
			best, bestW = i, w
		}
	}
	return best
}

// Rank returns the candidates from the highest weight down.
func Rank(tenant, clientID string, candidates []string) []string {
	type scored struct {
		node string
		w    uint64
	}
	s := make([]scored, len(candidates))
	for i, c := range candidates {
		s[i] = scored{c, Weight(c, tenant, clientID)}
	}
	slices.SortFunc(s, func(a, b scored) int {
		switch {
		case a.w > b.w:
			return -1
		case a.w < b.w:
			return 1
		}
		return 0
	})
	out := make([]string, len(s))
	for i := range s {
		out[i] = s[i].node
	}
	return out
}

// mix is the splitmix64 finaliser; FNV alone spreads similar keys poorly.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}
