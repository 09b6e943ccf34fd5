package loadgen

// bitset is a growable set of sequence numbers.
type bitset struct{ w []uint64 }

// set adds i and reports whether it was already present.
func (b *bitset) set(i uint64) (was bool) {
	k := int(i >> 6)
	if k >= len(b.w) {
		b.w = append(b.w, make([]uint64, k-len(b.w)+1+len(b.w)/2)...)
	}
	m := uint64(1) << (i & 63)
	was = b.w[k]&m != 0
	b.w[k] |= m
	return was
}

func (b *bitset) has(i uint64) bool {
	k := int(i >> 6)
	return k < len(b.w) && b.w[k]&(1<<(i&63)) != 0
}
