package topic

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// collect returns the values t.Match visits for topic, sorted.
func collect[V comparable](t *Trie[V], topic string, less func(a, b V) int) []V {
	var got []V
	t.Match(topic, func(v V) bool {
		got = append(got, v)
		return true
	})
	slices.SortFunc(got, less)
	return got
}

// requireEmpty checks that a trie with no pairs holds no nodes either.
func requireEmpty[V comparable](t *testing.T, tr *Trie[V]) {
	t.Helper()
	require.Zero(t, tr.Len())
	require.True(t, tr.root.empty(), "root still has children: %+v", tr.root)
}

func TestTrie_Match(t *testing.T) {
	t.Parallel()
	for _, tc := range matchCases {
		var tr Trie[int]
		require.True(t, tr.Add(tc.filter, 1))
		var got []int
		tr.Match(tc.topic, func(v int) bool { got = append(got, v); return true })
		want := []int(nil)
		if tc.want {
			want = []int{1}
		}
		require.Equal(t, want, got, "filter %q topic %q", tc.filter, tc.topic)
	}
}

// TestTrie_MatchAll puts every filter of the table in one trie and checks each
// topic against all of them.
func TestTrie_MatchAll(t *testing.T) {
	t.Parallel()
	var tr Trie[int]
	var filters []string
	for _, tc := range matchCases {
		if !slices.Contains(filters, tc.filter) {
			filters = append(filters, tc.filter)
			require.True(t, tr.Add(tc.filter, len(filters)-1))
		}
	}
	for _, tc := range matchCases {
		checkTrie(t, &tr, filters, tc.topic)
	}
}

// checkTrie compares the values tr visits for topic with Match over filters,
// where value i was added for filters[i].
func checkTrie(t *testing.T, tr *Trie[int], filters []string, topic string) {
	t.Helper()
	var want []int
	for i, f := range filters {
		if Match(f, topic) {
			want = append(want, i)
		}
	}
	got := collect(tr, topic, func(a, b int) int { return a - b })
	require.Equal(t, want, got, "topic %q", topic)
}

func TestTrie_AddRemove(t *testing.T) {
	t.Parallel()
	var tr Trie[string]
	require.True(t, tr.Add("a/+/c", "x"))
	require.False(t, tr.Add("a/+/c", "x"), "same pair twice")
	require.True(t, tr.Add("a/+/c", "y"))
	require.True(t, tr.Add("a/#", "x"))
	require.True(t, tr.Add("#", "x"))
	require.True(t, tr.Add("a/#/c", "x")) // not valid, but must round-trip
	require.True(t, tr.Add("", "x"))
	require.Equal(t, 5+1, tr.Len())

	require.Equal(t, []string{"x", "x", "x", "y"}, collect(&tr, "a/b/c", strings.Compare))
	require.Equal(t, []string{"x", "x", "x", "x", "y"}, collect(&tr, "a/#/c", strings.Compare))
	require.Equal(t, []string{"x", "x"}, collect(&tr, "", strings.Compare))

	require.False(t, tr.Remove("a/+/c", "z"), "absent value")
	require.False(t, tr.Remove("a/b/c", "x"), "absent filter")
	require.False(t, tr.Remove("a/+", "x"), "prefix of a filter")
	require.False(t, tr.Remove("a/+/c/d", "x"), "extension of a filter")
	require.True(t, tr.Remove("a/+/c", "x"))
	require.False(t, tr.Remove("a/+/c", "x"), "removed twice")
	require.Equal(t, []string{"x", "x", "y"}, collect(&tr, "a/b/c", strings.Compare))
	for _, f := range []string{"a/+/c", "a/#", "#", "a/#/c", ""} {
		v := "x"
		if f == "a/+/c" {
			v = "y"
		}
		require.True(t, tr.Remove(f, v), f)
	}
	requireEmpty(t, &tr)
	require.Empty(t, collect(&tr, "a/b/c", strings.Compare))
}

// TestTrie_ManySubscribers crosses the size at which a value set builds its
// index, in both directions.
func TestTrie_ManySubscribers(t *testing.T) {
	t.Parallel()
	var tr Trie[int]
	const n = 200
	for round := range 3 {
		for i := range n {
			require.True(t, tr.Add("a/+", i), "round %d add %d", round, i)
			require.False(t, tr.Add("a/+", i))
		}
		require.Equal(t, n, tr.Len())
		got := collect(&tr, "a/b", func(a, b int) int { return a - b })
		require.Len(t, got, n)
		for i, v := range got {
			require.Equal(t, i, v)
		}
		// Remove in an order that moves values around.
		for i := 0; i < n; i += 2 {
			require.True(t, tr.Remove("a/+", i))
		}
		for i := n - 1; i > 0; i -= 2 {
			require.True(t, tr.Remove("a/+", i), "round %d remove %d", round, i)
			require.False(t, tr.Remove("a/+", i))
		}
		requireEmpty(t, &tr)
	}
}

func TestTrie_MatchStops(t *testing.T) {
	t.Parallel()
	var tr Trie[int]
	for i, f := range []string{"#", "a/#", "+/b", "a/b", "a/+", "+/+", "a/b/#"} {
		tr.Add(f, i)
		tr.Add(f, i+100)
	}
	for limit := 1; limit <= 14; limit++ {
		calls := 0
		tr.Match("a/b", func(int) bool {
			calls++
			return calls < limit
		})
		require.Equal(t, limit, calls)
	}
}

// TestTrie_DollarTopics checks [MQTT-4.7.2-1] through the trie: root-level
// wildcards never see '$' topics, deeper ones do.
func TestTrie_DollarTopics(t *testing.T) {
	t.Parallel()
	var tr Trie[string]
	for _, f := range []string{"#", "+", "+/#", "+/broker/uptime", "$SYS/#", "$SYS/+/uptime", "a/+", "a/#"} {
		tr.Add(f, f)
	}
	require.Equal(t, []string{"$SYS/#", "$SYS/+/uptime"}, collect(&tr, "$SYS/broker/uptime", strings.Compare))
	require.Equal(t, []string{"$SYS/#"}, collect(&tr, "$SYS", strings.Compare))
	require.Empty(t, collect(&tr, "$", strings.Compare))
	require.Equal(t, []string{"#", "+/#", "a/#", "a/+"}, collect(&tr, "a/$b", strings.Compare))
}

func TestTrie_MatchAllocs(t *testing.T) {
	var tr Trie[int]
	for i := range 1000 {
		tr.Add(fmt.Sprintf("+/dev%d/#", i), i)
		tr.Add(fmt.Sprintf("site/+/x%d", i), i)
		tr.Add(fmt.Sprintf("site/dev%d", i), i)
	}
	tr.Add("#", -1)
	n := 0
	fn := func(int) bool { n++; return true }
	allocs := testing.AllocsPerRun(1000, func() {
		tr.Match("site/dev7/x", fn)
		tr.Match("site/dev7", fn)
		tr.Match("site/dev7/x7", fn)
		tr.Match("$SYS/dev7/x7", fn)
	})
	require.Zero(t, allocs)
	require.Positive(t, n)

	// A closure written at the call site stays on the stack too.
	allocs = testing.AllocsPerRun(1000, func() {
		sum := 0
		tr.Match("site/dev7/x7", func(v int) bool { sum += v; return true })
		n += sum
	})
	require.Zero(t, allocs)
}

// TestTrie_ConcurrentReaders runs Match from many goroutines under a read lock
// while a writer adds and removes under the write lock. Under -race it shows
// that Match only reads.
func TestTrie_ConcurrentReaders(t *testing.T) {
	t.Parallel()
	var (
		mu sync.RWMutex
		tr Trie[int]
		wg sync.WaitGroup
	)
	for i := range 100 {
		tr.Add(fmt.Sprintf("a/+/%d", i), i)
	}
	stop := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				mu.RLock()
				tr.Match("a/b/7", func(int) bool { return true })
				tr.Match("a/c/70", func(int) bool { return true })
				_ = tr.Len()
				mu.RUnlock()
			}
		})
	}
	for i := range 2000 {
		f := fmt.Sprintf("a/%d/#", i%50)
		mu.Lock()
		if i%2 == 0 {
			tr.Add(f, i)
		} else {
			tr.Remove(fmt.Sprintf("a/%d/#", (i-1)%50), i-1)
		}
		mu.Unlock()
	}
	close(stop)
	wg.Wait()
	require.Equal(t, 100, tr.Len())
}

// Levels the property test builds filters and topics from: ordinary and
// empty levels, '$' levels, whole and partial wildcards.
var (
	propFilterLevels = []string{"a", "b", "", "$", "$SYS", "+", "+", "#", "#", "a+", "#b"}
	propTopicLevels  = []string{"a", "b", "", "$", "$SYS", "c", "+", "#"}
)

func randomPath(r *rand.Rand, levels []string, maxLevels int) string {
	n := 1 + r.IntN(maxLevels)
	parts := make([]string, n)
	for i := range parts {
		parts[i] = levels[r.IntN(len(levels))]
	}
	return strings.Join(parts, "/")
}

// TestTrie_Property builds tries from random filters (valid and not, with
// '$' levels and empty levels such as "a//b" and "/x") and checks every
// random topic against Match, then removes filters in random order, checking
// again as it goes, until the trie is empty.
func TestTrie_Property(t *testing.T) {
	t.Parallel()
	seed := uint64(20240601)
	r := rand.New(rand.NewPCG(seed, seed))
	for round := range 200 {
		var tr Trie[int]
		filters := make([]string, 1+r.IntN(60))
		for i := range filters {
			filters[i] = randomPath(r, propFilterLevels, 5)
			require.True(t, tr.Add(filters[i], i))
		}
		require.Equal(t, len(filters), tr.Len())
		topics := make([]string, 50)
		for i := range topics {
			topics[i] = randomPath(r, propTopicLevels, 6)
			checkTrie(t, &tr, filters, topics[i])
			checkAnchor(t, filters[r.IntN(len(filters))], topics[i])
		}
		for _, i := range r.Perm(len(filters)) {
			require.True(t, tr.Remove(filters[i], i), "round %d seed %d", round, seed)
			filters[i] = "\x00removed" // matches no topic generated here
			checkTrie(t, &tr, filters, topics[r.IntN(len(topics))])
		}
		requireEmpty(t, &tr)
	}
}
