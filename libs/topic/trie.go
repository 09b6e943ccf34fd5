package topic

import "strings"

// Trie maps topic filters to sets of subscriber values and finds, for a topic
// name, every value whose filter matches it. Values are compared with ==; an
// interface V must only ever hold comparable dynamic values.
//
// Each topic level is one edge of the trie: literal levels are looked up in a
// map, and every node keeps its '+' child and the values of its "/#" filters
// apart, so a match costs a few map lookups per topic level and wildcard
// branch, however many filters there are, and allocates nothing.
//
// A Trie is not safe for concurrent use. [Trie.Match] and [Trie.Len] only read
// it (no lazy pruning, no caches), so callers may guard a Trie with a
// sync.RWMutex: any number of Match calls under the read lock, [Trie.Add] and
// [Trie.Remove] under the write lock.
//
// The zero value is an empty trie ready to use. Filters are stored as given:
// validate them with [ValidateFilter] and strip share prefixes with
// [ParseShare] first. A trie matches exactly like [Match], including for
// unvalidated input.
type Trie[V comparable] struct {
	root node[V]
	n    int
}

// node is one topic level. The root is the level before the first one, so only
// its lits, plus and hash are used: every filter has at least one level.
type node[V comparable] struct {
	lits map[string]*node[V] // children by literal level, including a non-final "#"
	plus *node[V]            // child for a "+" level
	subs set[V]              // values of the filters that end at this node
	hash set[V]              // values of the filters that end at this node + "/#"
}

func (n *node[V]) empty() bool {
	return len(n.lits) == 0 && n.plus == nil && len(n.subs.vals) == 0 && len(n.hash.vals) == 0
}

// Len returns the number of (filter, value) pairs in the trie.
func (t *Trie[V]) Len() int { return t.n }

// Add subscribes v to filter and reports whether the pair is new. Adding a pair
// that is already present changes nothing.
func (t *Trie[V]) Add(filter string, v V) bool {
	n := &t.root
	for rest, more := filter, true; more; {
		var level string
		level, rest, more = cutLevel(rest)
		switch {
		case level == "#" && !more:
			return t.added(n.hash.add(v))
		case level == "+":
			if n.plus == nil {
				n.plus = new(node[V])
			}
			n = n.plus
		default:
			c := n.lits[level]
			if c == nil {
				if n.lits == nil {
					n.lits = make(map[string]*node[V])
				}
				c = new(node[V])
				// Clone so that the trie does not pin the caller's filter,
				// which may be a view of a packet buffer.
				n.lits[strings.Clone(level)] = c
			}
			n = c
		}
	}
	return t.added(n.subs.add(v))
}

func (t *Trie[V]) added(ok bool) bool {
	if ok {
		t.n++
	}
	return ok
}

// Remove unsubscribes v from filter and reports whether the pair was present.
// Nodes left empty are freed.
func (t *Trie[V]) Remove(filter string, v V) bool {
	type step struct {
		parent *node[V]
		level  string
	}
	var buf [16]step
	path := buf[:0]
	n := &t.root
	s := (*set[V])(nil)
	for rest, more := filter, true; more; {
		var level string
		level, rest, more = cutLevel(rest)
		if level == "#" && !more {
			s = &n.hash
			break
		}
		var c *node[V]
		if level == "+" {
			c = n.plus
		} else {
			c = n.lits[level]
		}
		if c == nil {
			return false
		}
		path = append(path, step{n, level})
		n = c
	}
	if s == nil {
		s = &n.subs
	}
	if !s.remove(v) {
		return false
	}
	t.n--
	// Prune from the deepest node up, stopping at the first one still in use.
	for i := len(path) - 1; i >= 0 && n.empty(); i-- {
		p := path[i]
		if p.level == "+" {
			p.parent.plus = nil
		} else {
			delete(p.parent.lits, p.level)
			if len(p.parent.lits) == 0 {
				p.parent.lits = nil
			}
		}
		n = p.parent
	}
	return true
}

// Match calls fn with the value of every (filter, value) pair whose filter
// matches topic, as [Match] defines it, until fn returns false. A value
// subscribed through several matching filters is visited once per filter; the
// order is unspecified. Match only reads the trie and does not allocate; fn
// must not modify the trie.
func (t *Trie[V]) Match(topic string, fn func(V) bool) {
	if topic != "" && topic[0] == '$' {
		// Skip the root's "#" and "+" filters [MQTT-4.7.2-1].
		level, next := nextLevel(topic, 0)
		if c := t.root.lits[level]; c != nil {
			c.match(topic, next, fn)
		}
		return
	}
	t.root.match(topic, 0, fn)
}

// match visits the filters below n that match topic[i:], where n has matched
// the levels of topic before i. i == len(topic)+1 means that no level is left;
// i == len(topic) means one empty level is left (topic ends with '/'). It
// reports false when fn asked to stop.
func (n *node[V]) match(topic string, i int, fn func(V) bool) bool {
	for {
		// A "/#" here matches whatever is left, including nothing: "a/#"
		// matches "a" [MQTT-4.7.1-1].
		if !n.hash.visit(fn) {
			return false
		}
		if i > len(topic) {
			return n.subs.visit(fn)
		}
		level, next := nextLevel(topic, i)
		if n.plus != nil && !n.plus.match(topic, next, fn) {
			return false
		}
		c := n.lits[level]
		if c == nil {
			return true
		}
		n, i = c, next
	}
}

// nextLevel returns the level of topic that starts at i and the start of the
// level after it, len(topic)+1 if there is none.
func nextLevel(topic string, i int) (level string, next int) {
	if j := strings.IndexByte(topic[i:], '/'); j >= 0 {
		return topic[i : i+j], i + j + 1
	}
	return topic[i:], len(topic) + 1
}

// setIndexMin is the size from which a set keeps an index from value to
// position, so that Add and Remove stay O(1) for filters with many
// subscribers. Smaller sets are scanned, which is faster and smaller.
const setIndexMin = 16

// set is a set of values kept in a slice, so that visiting it is a plain loop.
type set[V comparable] struct {
	vals []V
	idx  map[V]int // position of each value in vals; nil below setIndexMin
}

func (s *set[V]) find(v V) int {
	if s.idx != nil {
		if i, ok := s.idx[v]; ok {
			return i
		}
		return -1
	}
	for i, x := range s.vals {
		if x == v {
			return i
		}
	}
	return -1
}

func (s *set[V]) add(v V) bool {
	if s.find(v) >= 0 {
		return false
	}
	s.vals = append(s.vals, v)
	switch {
	case s.idx != nil:
		s.idx[v] = len(s.vals) - 1
	case len(s.vals) >= setIndexMin:
		s.idx = make(map[V]int, len(s.vals))
		for i, x := range s.vals {
			s.idx[x] = i
		}
	}
	return true
}

func (s *set[V]) remove(v V) bool {
	i := s.find(v)
	if i < 0 {
		return false
	}
	last := len(s.vals) - 1
	if i != last {
		s.vals[i] = s.vals[last]
		if s.idx != nil {
			s.idx[s.vals[i]] = i
		}
	}
	var zero V
	s.vals[last] = zero // do not keep the value reachable
	s.vals = s.vals[:last]
	if s.idx != nil {
		delete(s.idx, v)
		if len(s.vals) < setIndexMin/2 {
			s.idx = nil // hysteresis: rebuilt only at setIndexMin again
		}
	}
	switch {
	case len(s.vals) == 0:
		s.vals = nil
	case cap(s.vals) >= 64 && len(s.vals) <= cap(s.vals)/4:
		s.vals = append([]V(nil), s.vals...)
	}
	return true
}

// visit calls fn for each value and reports false as soon as fn does.
func (s *set[V]) visit(fn func(V) bool) bool {
	for _, v := range s.vals {
		if !fn(v) {
			return false
		}
	}
	return true
}
