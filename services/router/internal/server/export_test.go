package server

import (
	"context"

	"github.com/keelmq/keel/libs/routes"
	routerv1 "github.com/keelmq/keel/proto/gen/keel/router/v1"
)

// OwnerOfAnchor returns the router node, among members, that writes the
// route key of (tenant, anchor): its single writer, which notifies the
// other nodes of changes to it.
func OwnerOfAnchor(tenant, anchor string, members []string) (string, error) {
	return rendezvous(anchorKey(tenant, anchor), members)
}

// NotifyBacklog returns how many notifications n holds for router nodes
// that did not answer them yet.
func (n *Node) NotifyBacklog() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	var q int
	for _, ob := range n.outbox {
		q += len(ob.items)
	}
	return q
}

// ForgetRoutes makes n's replicas lack anchor in tenant's Bloom filter and
// filter in its wildcard replica, as a reload whose Olric scan missed their
// keys leaves them, and sends its edges the table again (as a restarted
// node's edges get it when they connect).
func (n *Node) ForgetRoutes(tenant, anchor, filter string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if bs := n.blooms[tenant]; bs != nil {
		nb := newBloomState(bs.capacity, bs.version)
		for a := range bs.anchors {
			if a != anchor {
				nb.anchors[a] = struct{}{}
				nb.bloom.Add(a)
			}
		}
		n.blooms[tenant] = nb
	}
	if w := n.wild[tenant]; w != nil {
		for r, es := range w.set.Routes {
			if r.Filter != filter {
				continue
			}
			for e := range es {
				w.trie.Remove(r.Filter, wildVal{route: r, edge: e})
			}
			delete(w.set.Routes, r)
		}
	}
	for _, c := range n.conns {
		n.sendInitialLocked(c)
	}
}

// RequestResync asks every edge streaming to n for its route set, as a
// settle round does.
func (n *Node) RequestResync() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, c := range n.conns {
		n.requestResyncLocked(c)
	}
}

// ApplyAndDie does what an owner of the route key that died before it
// notified anyone leaves behind, for the delta d of edge id (incarnation
// inc): the key holds the change, the edge's record says it was applied,
// and no other node nor any edge heard of it.
func (n *Node) ApplyAndDie(ctx context.Context, id string, inc uint64, d *routerv1.RouteDelta) error {
	if _, _, _, err := n.applyKey(ctx, routeKey(keyOf(d.GetRoute())), []*routerv1.EdgeDelta{{EdgeId: id, Incarnation: inc, Delta: d}}); err != nil {
		return err
	}
	var dig routes.Digest
	dig.Add(keyOf(d.GetRoute()))
	return n.storeEdge(ctx, id, edgeRecord{Inc: inc, Seq: d.GetSeq(), Count: dig.Count, Sum: dig.Sum, SnapView: n.View()})
}
