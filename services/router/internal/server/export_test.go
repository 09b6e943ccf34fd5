package server

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
