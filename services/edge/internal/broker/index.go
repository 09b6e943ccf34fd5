package broker

import (
	"cmp"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/keelmq/keel/libs/topic"
)

// subscription is one filter of one session, in internal form.
type subscription struct {
	sess    *session
	filter  string // the filter matched against topics (the inner filter of a share)
	full    string // the filter as subscribed ("$share/g/..." for shares)
	qos     byte
	noLocal bool
	rap     bool // retain as published
	rh      byte // retain handling
	ids     []int
	group   *shareGroup
	// counted: the cluster's route client counts this subscription in its
	// route's count. It turns true once an Add returned counted, and the
	// count is removed by whoever turns it back to false, exactly once.
	counted atomic.Bool
}

// shareGroup is one shared subscription group on one filter.
type shareGroup struct {
	name    string
	filter  string
	members []*subscription // guarded by index.mu
	next    atomic.Uint32
}

// index holds every subscription of the edge.
//
// Lock order: index.mu before session.mu.
type index struct {
	mu     sync.RWMutex
	subs   topic.Trie[*subscription]
	groups topic.Trie[*shareGroup]
	byKey  map[string]*shareGroup // name + "\x00" + filter
	count  atomic.Int64
}

func newIndex() *index {
	return &index{byKey: map[string]*shareGroup{}}
}

func (x *index) add(s *subscription) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.addLocked(s)
}

// addIfHeld adds s if held(), asked under the index's lock, says its
// session holds it, and reports whether it did. Whatever takes s out of its
// session removes it from the index afterwards, so s is never left in the
// index for a session that let it go. held takes the session's lock (index
// before session).
func (x *index) addIfHeld(s *subscription, held func() bool) bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	if !held() {
		return false
	}
	x.addLocked(s)
	return true
}

func (x *index) addLocked(s *subscription) {
	if s.group == nil {
		if x.subs.Add(s.filter, s) {
			x.count.Add(1)
		}
		return
	}
	key := s.group.name + "\x00" + s.filter
	g := x.byKey[key]
	if g == nil {
		g = s.group
		x.byKey[key] = g
		x.groups.Add(s.filter, g)
	}
	if slices.Contains(g.members, s) {
		return // added already
	}
	s.group = g
	x.count.Add(1)
	g.members = append(g.members, s)
}

func (x *index) remove(s *subscription) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if s.group == nil {
		if x.subs.Remove(s.filter, s) {
			x.count.Add(-1)
		}
		return
	}
	g := s.group
	i := slices.Index(g.members, s)
	if i < 0 {
		return // removed already: its group may be gone, and another in its place
	}
	g.members = slices.Delete(g.members, i, i+1)
	x.count.Add(-1)
	if len(g.members) == 0 {
		delete(x.byKey, g.name+"\x00"+g.filter)
		x.groups.Remove(g.filter, g)
	}
}

// target is one recipient of a message.
type target struct {
	sess    *session
	qos     byte
	rap     bool
	noLocal bool
	ids     []int
	shared  bool
	// group is the shared group that picked the session, if one did.
	group *shareGroup
	// more is the other groups that picked the session for the same
	// message (merged into this delivery): it serves them too.
	more []*shareGroup
}

// match appends to dst every recipient of a message published on topic,
// one per session: overlapping subscriptions of a session merge into one
// delivery at the highest QoS carrying every subscription identifier
// (MQTT 5.0 §3.3.4). One member of each shared group is picked, connected
// members first, round robin.
//
// serve, when not nil, says which shared groups this edge serves for the
// message (another edge may serve the others); groupsOnly leaves out every
// recipient but those groups' members. again holds the members that took
// the message before (sharedPicks): a group picks its member there again,
// and one that took it at QoS 2 and is gone is not replaced.
func (x *index) match(topicName string, dst []target, serve func(*shareGroup) bool, groupsOnly bool, again []groupPick) []target {
	x.mu.RLock()
	if !groupsOnly {
		x.subs.Match(topicName, func(s *subscription) bool {
			dst = append(dst, target{sess: s.sess, qos: s.qos, rap: s.rap, noLocal: s.noLocal, ids: s.ids})
			return true
		})
	}
	x.groups.Match(topicName, func(g *shareGroup) bool {
		if serve != nil && !serve(g) {
			return true
		}
		var m *subscription
		if p := pickFor(again, g); p != nil {
			if m = g.member(p.session); m == nil && p.qos == 2 {
				return true // committed to its member ([MQTT-4.8.2-5])
			}
		}
		if m == nil {
			m = g.pick()
		}
		if m != nil {
			dst = append(dst, target{sess: m.sess, qos: m.qos, ids: m.ids, shared: true, group: g})
		}
		return true
	})
	x.mu.RUnlock()
	if len(dst) < 2 {
		return dst
	}
	// Only a session with several subscriptions can appear twice.
	multi := 0
	for i := range dst {
		if dst[i].sess.nsubs.Load() > 1 {
			multi++
		}
	}
	if multi < 2 {
		return dst
	}
	if len(dst) <= smallMerge {
		// Few recipients (the common case): merge in place without sorting,
		// which keeps the publisher's stack small.
		out := dst[:0]
		for _, t := range dst {
			merged := false
			for i := range out {
				if out[i].sess == t.sess {
					mergeTarget(&out[i], t)
					merged = true
					break
				}
			}
			if !merged {
				out = append(out, t)
			}
		}
		return out
	}
	slices.SortFunc(dst, func(a, b target) int {
		return cmp.Compare(uintptr(unsafe.Pointer(a.sess)), uintptr(unsafe.Pointer(b.sess)))
	})
	out := dst[:1]
	for _, t := range dst[1:] {
		if last := &out[len(out)-1]; last.sess == t.sess {
			mergeTarget(last, t)
			continue
		}
		out = append(out, t)
	}
	return out
}

// smallMerge is the recipient count up to which match merges by scanning.
const smallMerge = 16

// mergeTarget folds t, another subscription of the same session, into last.
func mergeTarget(last *target, t target) {
	last.qos = max(last.qos, t.qos)
	last.rap = last.rap || t.rap
	// A shared delivery is never suppressed by no-local ([MQTT-3.8.3-4]);
	// an ordinary one is only when every overlapping filter says so.
	last.noLocal = last.noLocal && t.noLocal
	last.shared = last.shared && t.shared
	switch {
	case last.group == nil:
		last.group = t.group
	case t.group != nil:
		last.more = append(last.more, t.group)
	}
	last.more = append(last.more, t.more...)
	if len(t.ids) > 0 {
		merged := make([]int, 0, len(last.ids)+len(t.ids))
		merged = append(merged, last.ids...)
		merged = append(merged, t.ids...)
		slices.Sort(merged)
		last.ids = slices.Compact(merged)
	}
}

// pickOther returns the next member of the group named name on filter
// (internal form) other than one of except's, connected if online is set;
// nil if there is none.
func (x *index) pickOther(name, filter string, except *session, online bool) *subscription {
	return x.pickNotIn(name, filter, []*session{except}, online)
}

// pickNotIn is pickOther leaving out the members of every session in
// except.
func (x *index) pickNotIn(name, filter string, except []*session, online bool) *subscription {
	x.mu.RLock()
	defer x.mu.RUnlock()
	g := x.byKey[name+"\x00"+filter]
	if g == nil {
		return nil
	}
	n := uint32(len(g.members))
	start := g.next.Add(1)
	for i := range n {
		if m := g.members[(start+i)%n]; !slices.Contains(except, m.sess) && (!online || m.sess.online.Load()) {
			return m
		}
	}
	return nil
}

// pick returns the next member of g, preferring connected sessions.
// index.mu must be held (read).
func (g *shareGroup) pick() *subscription {
	n := uint32(len(g.members))
	if n == 0 {
		return nil
	}
	start := g.next.Add(1)
	for i := range n {
		m := g.members[(start+i)%n]
		if m.sess.online.Load() {
			return m
		}
	}
	// No member is connected: a persistent member's queue takes it.
	return g.members[start%n]
}
