package broker

import (
	"context"
	"strings"
	"sync"
	"time"
)

// retainedStore keeps the last retained message per internal topic and
// answers filter lookups by walking a tree of topic levels, so a wildcard
// lookup visits only the branches the filter can match.
type retainedStore struct {
	mu   sync.RWMutex
	root *rnode
	n    int
}

type rnode struct {
	children map[string]*rnode
	msg      *Message
}

func newRetainedStore() *retainedStore { return &retainedStore{root: &rnode{}} }

// set stores m, or deletes the entry when m has an empty payload
// ([MQTT-3.3.1-6], [MQTT-3.3.1-7]). It returns the change in entry count.
func (r *retainedStore) set(m *Message) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.root
	path := []*rnode{n}
	rest := m.Topic
	for {
		level, tail, more := strings.Cut(rest, "/")
		child := n.children[level]
		if child == nil {
			if len(m.Payload) == 0 {
				return 0
			}
			if n.children == nil {
				n.children = map[string]*rnode{}
			}
			child = &rnode{}
			n.children[level] = child
		}
		n = child
		path = append(path, n)
		if !more {
			break
		}
		rest = tail
	}
	had := n.msg != nil
	if len(m.Payload) == 0 {
		n.msg = nil
		r.prune(path, m.Topic)
		if had {
			r.n--
			return -1
		}
		return 0
	}
	n.msg = m
	if !had {
		r.n++
		return 1
	}
	return 0
}

func (r *retainedStore) prune(path []*rnode, topicName string) {
	levels := strings.Split(topicName, "/")
	for i := len(path) - 1; i > 0; i-- {
		n := path[i]
		if n.msg != nil || len(n.children) > 0 {
			return
		}
		delete(path[i-1].children, levels[i-1])
	}
}

func (r *retainedStore) len() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.n
}

// match calls fn for each retained message whose topic matches the internal
// filter. Filters here always start with a literal tenant level, so the $-topic
// rule is applied at the level after it.
func (r *retainedStore) match(filter string, now int64, fn func(*Message)) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	tenantLevel, rest, ok := strings.Cut(filter, "/")
	if !ok {
		return
	}
	n := r.root.children[tenantLevel]
	if n == nil {
		return
	}
	r.walk(n, rest, true, now, fn)
}

func (r *retainedStore) walk(n *rnode, filter string, first bool, now int64, fn func(*Message)) {
	level, rest, more := strings.Cut(filter, "/")
	switch level {
	case "#":
		// "a/#" also matches "a" itself ([MQTT-4.7.1-2]).
		if n.msg != nil && !first {
			emit(n.msg, now, fn)
		}
		r.all(n, first, now, fn)
		return
	case "+":
		for key, c := range n.children {
			if first && strings.HasPrefix(key, "$") {
				continue
			}
			r.step(c, rest, more, now, fn)
		}
		return
	}
	if c := n.children[level]; c != nil {
		r.step(c, rest, more, now, fn)
	}
}

func (r *retainedStore) step(c *rnode, rest string, more bool, now int64, fn func(*Message)) {
	if !more {
		if c.msg != nil {
			emit(c.msg, now, fn)
		}
		return
	}
	r.walk(c, rest, false, now, fn)
}

func (r *retainedStore) all(n *rnode, first bool, now int64, fn func(*Message)) {
	for key, c := range n.children {
		if first && strings.HasPrefix(key, "$") {
			continue
		}
		if c.msg != nil {
			emit(c.msg, now, fn)
		}
		r.all(c, false, now, fn)
	}
}

func emit(m *Message, now int64, fn func(*Message)) {
	if m.Expiry != 0 && m.Expiry <= now {
		return // expired retained messages are not sent ([MQTT-3.3.2-5])
	}
	fn(m)
}

// retainedWrites holds, per topic, the last retained message (or clear)
// of this edge that the shared store has not answered yet. Once it has,
// the store's answer is the truth for that topic, whatever this edge's
// tree still holds: a clear or a newer message published on another edge
// reaches this edge's tree only if a route brought it here.
type retainedWrites struct {
	mu      sync.Mutex
	pending map[string]*Message
}

func (w *retainedWrites) start(m *Message) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pending == nil {
		w.pending = map[string]*Message{}
	}
	w.pending[m.Topic] = m
}

// done records that the store answered m's write; a later write of the
// topic stays pending.
func (w *retainedWrites) done(m *Message) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pending[m.Topic] == m {
		delete(w.pending, m.Topic)
	}
}

func (w *retainedWrites) of(topicName string) *Message {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending[topicName]
}

// retainedLookupTimeout bounds the shared store's retained lookup on a
// subscriber's path.
const retainedLookupTimeout = 5 * time.Second

// matchRetained calls fn with the retained messages matching filter. With
// a shared store, they are the store's, and this edge's own whose writes
// the store has not answered yet (retainedWrites), the newest per topic;
// a clear not answered yet hides an older stored message. A store that
// cannot answer leaves the subscriber with this edge's.
func (b *Broker) matchRetained(filter string, now int64, fn func(*Message)) {
	idx, ok := b.store.(RetainedIndex)
	if !ok {
		b.retained.match(filter, now, fn)
		return
	}
	byTopic := map[string]*Message{}
	var order []string
	keep := func(m *Message) {
		old, seen := byTopic[m.Topic]
		if !seen {
			order = append(order, m.Topic)
		}
		if !seen || m.Created > old.Created {
			byTopic[m.Topic] = m
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), retainedLookupTimeout)
	stored, err := idx.MatchRetained(ctx, filter)
	cancel()
	if err != nil {
		b.m.packetErrors.WithLabelValues("retained_lookup_failed").Inc()
		b.logger.Warn("retained lookup in the shared store failed; sending this edge's only", "filter", filter, "error", err)
		b.retained.match(filter, now, keep)
	} else {
		b.retained.match(filter, now, func(m *Message) {
			if b.retainedWrites.of(m.Topic) == m {
				keep(m)
			}
		})
	}
	for i := range stored {
		m := fromRecord(&stored[i])
		if p := b.retainedWrites.of(m.Topic); p != nil && len(p.Payload) == 0 && p.Created >= m.Created {
			continue // cleared here, the store not told yet
		}
		emit(m, now, keep)
	}
	for _, t := range order {
		if m := byTopic[t]; len(m.Payload) > 0 {
			fn(m)
		}
	}
}
