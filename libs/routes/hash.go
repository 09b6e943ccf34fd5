package routes

// fnv64a hashes s with FNV-1a, without allocating.
func fnv64a(h uint64, s string) uint64 {
	const prime = 1099511628211
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= prime
	}
	return h
}

const fnvOffset = 14695981039346656037

// mix64 is the splitmix64 finaliser: it spreads every input bit over the output.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// Hash returns the 64-bit hash of a route used by [Digest]. It is part of the
// wire contract between edge and router: never change it.
func Hash(k Key) uint64 {
	h := fnv64a(fnvOffset, k.Tenant)
	h = fnv64a(h^0xff, k.Group)
	h = fnv64a(h^0xfe, k.Filter)
	return mix64(h)
}

// Digest summarises a set of routes independently of order: the count and the
// sum modulo 2^64 of their [Hash]es, so adding and removing are O(1).
type Digest struct {
	Count uint64
	Sum   uint64
}

// Add adds k to the digest.
func (d *Digest) Add(k Key) { d.Count++; d.Sum += Hash(k) }

// Remove removes k from the digest.
func (d *Digest) Remove(k Key) { d.Count--; d.Sum -= Hash(k) }
