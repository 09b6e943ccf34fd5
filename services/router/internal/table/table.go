// Package table is the router's route model: the versioned value stored in
// Olric under one route key, (tenant, anchor) for anchored filters or
// (tenant) for the wildcard-first table, and the rules for applying an edge's
// deltas to it. It is pure data: no I/O, no locks. The caller applies deltas
// as the key's single writer.
package table

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
)

// Route is a filter with its share group (empty when not shared), without the
// tenant, which the key of the [Set] carries.
type Route struct {
	Filter string
	Group  string
}

// Entry is one edge's hold on a route: its local subscriber count, and the
// incarnation and delta seq that last set it.
type Entry struct {
	Count uint32 `json:"n,omitempty"`
	Inc   uint64 `json:"i"`
	Seq   uint64 `json:"s"`
}

// Op is the change a delta makes.
type Op uint8

// Ops.
const (
	OpAdd Op = iota + 1
	OpRemove
)

// Delta is one change by one edge incarnation.
type Delta struct {
	Edge  string
	Inc   uint64
	Seq   uint64
	Op    Op
	Route Route
	Count uint32
}

// Set is the value of one route key: every route stored under it and the
// edges holding each. Version counts the changes applied.
type Set struct {
	Version uint64
	Routes  map[Route]map[string]Entry
}

// Len returns the number of routes (filter, group) in s.
func (s *Set) Len() int { return len(s.Routes) }

// Result says what applying a delta did.
type Result struct {
	// Changed is true when the stored value changed.
	Changed bool
	// Added is true when an edge gained the route (it may route to a new edge
	// now), which needs invalidation of contrary cache entries.
	Added bool
	// NewRoute is true when the route had no edge before.
	NewRoute bool
	// Removed is true when an edge lost the route.
	Removed bool
}

// Apply applies d to s. A delta from an older incarnation than the stored
// entry's, or with a seq not above it within one incarnation, is ignored, so
// replays and late forwards are harmless. A remove of a route the edge does
// not hold changes nothing.
func (s *Set) Apply(d Delta) Result {
	edges := s.Routes[d.Route]
	cur, has := edges[d.Edge]
	if has && (cur.Inc > d.Inc || cur.Inc == d.Inc && cur.Seq >= d.Seq) {
		return Result{}
	}
	switch d.Op {
	case OpAdd:
		if has && cur.Inc == d.Inc && (d.Count == 0 || d.Count == cur.Count) {
			// Re-sent by a resync: nothing to write. Count 0 means unknown.
			return Result{}
		}
		if s.Routes == nil {
			s.Routes = map[Route]map[string]Entry{}
		}
		if edges == nil {
			edges = map[string]Entry{}
			s.Routes[d.Route] = edges
		}
		e := Entry{Count: d.Count, Inc: d.Inc, Seq: d.Seq}
		edges[d.Edge] = e
		s.Version++
		return Result{Changed: true, Added: !has || cur.Inc != d.Inc, NewRoute: len(edges) == 1 && !has}
	case OpRemove:
		if !has {
			return Result{}
		}
		delete(edges, d.Edge)
		if len(edges) == 0 {
			delete(s.Routes, d.Route)
		}
		s.Version++
		return Result{Changed: true, Removed: true}
	}
	return Result{}
}

// Edges calls fn for every (route, edge, entry) in s, in no particular order.
func (s *Set) Edges(fn func(Route, string, Entry)) {
	for r, edges := range s.Routes {
		for id, e := range edges {
			fn(r, id, e)
		}
	}
}

// wire is the stored form of a Set: sorted, so equal sets encode equally.
type wire struct {
	V uint64      `json:"v"`
	R []wireRoute `json:"r"`
}

type wireRoute struct {
	F string     `json:"f"`
	G string     `json:"g,omitempty"`
	E []wireEdge `json:"e"`
}

type wireEdge struct {
	ID string `json:"id"`
	Entry
}

// Marshal encodes s for storage.
//
// TODO(router): a compact binary form; JSON keeps stored values readable
// while the format settles.
func (s *Set) Marshal() ([]byte, error) {
	w := wire{V: s.Version, R: make([]wireRoute, 0, len(s.Routes))}
	for r, edges := range s.Routes {
		wr := wireRoute{F: r.Filter, G: r.Group, E: make([]wireEdge, 0, len(edges))}
		for id, e := range edges {
			wr.E = append(wr.E, wireEdge{ID: id, Entry: e})
		}
		slices.SortFunc(wr.E, func(a, b wireEdge) int { return strings.Compare(a.ID, b.ID) })
		w.R = append(w.R, wr)
	}
	slices.SortFunc(w.R, func(a, b wireRoute) int {
		if c := strings.Compare(a.F, b.F); c != 0 {
			return c
		}
		return strings.Compare(a.G, b.G)
	})
	return json.Marshal(w)
}

// Unmarshal decodes a stored Set.
func Unmarshal(b []byte) (*Set, error) {
	var w wire
	if err := json.Unmarshal(b, &w); err != nil {
		return nil, fmt.Errorf("decode route set: %w", err)
	}
	s := &Set{Version: w.V, Routes: make(map[Route]map[string]Entry, len(w.R))}
	for _, r := range w.R {
		edges := make(map[string]Entry, len(r.E))
		for _, e := range r.E {
			edges[e.ID] = e.Entry
		}
		s.Routes[Route{Filter: r.F, Group: r.G}] = edges
	}
	return s, nil
}
