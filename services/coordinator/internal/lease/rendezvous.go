package lease

import "hash/fnv"

// Custodian picks the custodian of a session among candidate edge IDs by
// rendezvous (highest random weight) hashing of tenant + client ID: every
// leader picks the same one for the same candidates, and when a candidate
// leaves only its own sessions move. It returns -1 for no candidates.
func Custodian(tenant, clientID string, candidates []string) int {
	best, bestW := -1, uint64(0)
	for i, c := range candidates {
		h := fnv.New64a()
		_, _ = h.Write([]byte(c))
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(tenant))
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(clientID))
		w := mix(h.Sum64())
		if best < 0 || w > bestW {
			best, bestW = i, w
		}
	}
	return best
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
