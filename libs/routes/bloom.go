package routes

import (
	"fmt"
	"math"
)

// Bloom is a Bloom filter of anchor strings. The router builds one per tenant
// from the anchors that exist and streams it to edges; an edge that finds none
// of a topic's anchors in it knows, without an RPC, that no anchored route
// matches. Its hashing is part of the wire contract: never change it.
//
// A Bloom is not safe for concurrent use.
type Bloom struct {
	bits []byte
	m    uint64 // number of bits
	k    uint32 // number of hash functions
}

// NewBloom returns an empty filter sized for n anchors at false-positive rate p.
func NewBloom(n int, p float64) *Bloom {
	if n < 64 {
		n = 64
	}
	if p <= 0 || p >= 1 {
		p = 0.01
	}
	m := uint64(math.Ceil(-float64(n) * math.Log(p) / (math.Ln2 * math.Ln2)))
	m = (m + 63) &^ 63
	k := uint32(math.Round(float64(m) / float64(n) * math.Ln2))
	k = max(1, min(k, 16))
	return &Bloom{bits: make([]byte, m/8), m: m, k: k}
}

// BloomFromBits rebuilds a filter from its parameters and bits, as streamed.
func BloomFromBits(bits []byte, m uint64, k uint32) (*Bloom, error) {
	if m == 0 || m%8 != 0 || uint64(len(bits)) != m/8 || k == 0 || k > 32 {
		return nil, fmt.Errorf("%w: %d bits, %d bytes, %d hashes", ErrInvalidBloom, m, len(bits), k)
	}
	return &Bloom{bits: bits, m: m, k: k}, nil
}

// Bits returns the filter's bits (not a copy), its size in bits and hash count.
func (b *Bloom) Bits() ([]byte, uint64, uint32) { return b.bits, b.m, b.k }

// Clone returns an independent copy.
func (b *Bloom) Clone() *Bloom {
	return &Bloom{bits: append([]byte(nil), b.bits...), m: b.m, k: b.k}
}

// Add adds anchor to the filter.
func (b *Bloom) Add(anchor string) {
	h1, h2 := bloomHashes(anchor)
	for i := uint32(0); i < b.k; i++ {
		bit := (h1 + uint64(i)*h2) % b.m
		b.bits[bit/8] |= 1 << (bit % 8)
	}
}

// MayContain reports whether anchor may have been added; false is certain.
func (b *Bloom) MayContain(anchor string) bool {
	h1, h2 := bloomHashes(anchor)
	for i := uint32(0); i < b.k; i++ {
		bit := (h1 + uint64(i)*h2) % b.m
		if b.bits[bit/8]&(1<<(bit%8)) == 0 {
			return false
		}
	}
	return true
}

func bloomHashes(s string) (uint64, uint64) {
	h := fnv64a(fnvOffset, s)
	return mix64(h), mix64(h^0x9e3779b97f4a7c15) | 1
}
