package topic

import (
	"fmt"
	"testing"
)

// benchTrie returns a trie of n filters that all start with a wildcard, so
// that no anchor narrows them: half "+/dev<i>/#", half "+/+/x<i>". Such are
// the filters every edge holds (DESIGN.md, routing table). It also returns
// topics that each match one or two of them, and some that match none.
func benchTrie(n int) (*Trie[int], []string) {
	var tr Trie[int]
	for i := range n / 2 {
		tr.Add(fmt.Sprintf("+/dev%d/#", i), i)
		tr.Add(fmt.Sprintf("+/+/x%d", i), n/2+i)
	}
	topics := make([]string, 0, 1024)
	for i := range cap(topics) {
		k := (i * 7919) % (n / 2)
		switch i % 4 {
		case 0:
			topics = append(topics, fmt.Sprintf("site%d/dev%d/temp", i, k))
		case 1:
			topics = append(topics, fmt.Sprintf("site%d/dev%d/x%d", i, k, k))
		case 2:
			topics = append(topics, fmt.Sprintf("site%d/rack/x%d", i, k))
		default:
			topics = append(topics, fmt.Sprintf("site%d/none/y%d/z", i, k))
		}
	}
	return &tr, topics
}

func BenchmarkTrie_Match(b *testing.B) {
	for _, n := range []int{100, 10000, 100000} {
		b.Run(fmt.Sprintf("filters=%d", n), func(b *testing.B) {
			tr, topics := benchTrie(n)
			visited := 0
			fn := func(int) bool { visited++; return true }
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				tr.Match(topics[i%len(topics)], fn)
				i++
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "matches/s")
			b.ReportMetric(float64(visited)/float64(b.N), "visits/op")
		})
	}
}

// BenchmarkTrie_MatchDollar matches '$' topics, which skip the root's
// wildcard filters [MQTT-4.7.2-1].
func BenchmarkTrie_MatchDollar(b *testing.B) {
	tr, _ := benchTrie(10000)
	for i := range 1000 {
		tr.Add(fmt.Sprintf("$SYS/broker/+/n%d", i), i)
	}
	b.Run("filters=11000", func(b *testing.B) {
		fn := func(int) bool { return true }
		b.ReportAllocs()
		for b.Loop() {
			tr.Match("$SYS/broker/clients/n7", fn)
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "matches/s")
	})
}

func BenchmarkTrie_Add(b *testing.B) {
	filters := make([]string, 10000)
	for i := range filters {
		filters[i] = fmt.Sprintf("site%d/+/dev%d/#", i%100, i)
	}
	b.Run("filters=10000", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var tr Trie[int]
			for i, f := range filters {
				tr.Add(f, i)
			}
			for i, f := range filters {
				tr.Remove(f, i)
			}
		}
		b.ReportMetric(float64(b.N*len(filters))/b.Elapsed().Seconds(), "add+remove/s")
	})
}

func BenchmarkMatch(b *testing.B) {
	for _, tc := range []struct{ name, filter, topic string }{
		{"exact", "sport/tennis/player1/ranking", "sport/tennis/player1/ranking"},
		{"plus", "sport/+/player1/+", "sport/tennis/player1/ranking"},
		{"hash", "sport/#", "sport/tennis/player1/ranking"},
		{"miss", "sport/tennis/player2/#", "sport/tennis/player1/ranking"},
	} {
		b.Run("case="+tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				Match(tc.filter, tc.topic)
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "matches/s")
		})
	}
}

func BenchmarkValidate(b *testing.B) {
	for _, tc := range []struct{ name, s string }{
		{"ascii", "tenant-42/site/building-7/floor-3/sensor-0123/temperature"},
		{"unicode", "日本/東京/センサー/温度/caf\u00e9"},
		{"share", "$share/group-1/tenant-42/site/+/floor-3/#"},
	} {
		b.Run("input="+tc.name+"/kind=name", func(b *testing.B) {
			b.SetBytes(int64(len(tc.s)))
			b.ReportAllocs()
			for b.Loop() {
				_ = ValidateName(tc.s, Limits{MaxLevels: 16})
			}
		})
		b.Run("input="+tc.name+"/kind=filter", func(b *testing.B) {
			b.SetBytes(int64(len(tc.s)))
			b.ReportAllocs()
			for b.Loop() {
				_ = ValidateFilter(tc.s, Limits{MaxLevels: 16})
			}
		})
	}
}

func BenchmarkAnchor(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		_ = Anchor("tenant-42/site/building-7/+/sensor/#")
	}
}
