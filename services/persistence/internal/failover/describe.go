package failover

import (
	"context"
	"strconv"
	"sync"

	"github.com/keelmq/keel/services/persistence/internal/store/redisstore"
)

// NodeStatus is one node of a group as it answered [Promoter.Describe].
type NodeStatus struct {
	Addr string
	Err  error // the node could not be read; the rest is unset
	Role string
	// Following and LinkUp describe a replica's link.
	Following string
	LinkUp    bool
	Offset    int64
	ReplID    string
	// Lag is the primary's replication offset minus this node's, under one
	// replication ID; -1 when not known.
	Lag                   int64
	WriteEpoch, WriteSeq  uint64
	UsedMemory, MaxMemory uint64
	AOFRewriting          bool
}

// Describe reads every node of rec, primary first, in parallel, each within
// DialTimeout: an unreachable node is reported with its error.
func (p *Promoter) Describe(ctx context.Context, rec Record) []NodeStatus {
	nodes := append([]string{rec.Primary}, rec.Replicas...)
	out := make([]NodeStatus, len(nodes))
	var wg sync.WaitGroup
	for i, addr := range nodes {
		wg.Go(func() { out[i] = p.describe(ctx, addr) })
	}
	wg.Wait()
	primary := out[0]
	for i := range out {
		out[i].Lag = -1
		if out[i].Err == nil && primary.Err == nil && out[i].ReplID != "" && out[i].ReplID == primary.ReplID {
			out[i].Lag = max(primary.Offset-out[i].Offset, 0)
		}
	}
	return out
}

func (p *Promoter) describe(ctx context.Context, addr string) NodeStatus {
	st, info := p.read(ctx, addr, true, "memory", "persistence")
	if st.err != nil {
		return NodeStatus{Addr: addr, Err: st.err}
	}
	ns := NodeStatus{Addr: addr, Role: st.role, LinkUp: st.linkUp, Offset: st.offset, ReplID: st.replid,
		WriteEpoch: st.held.epoch, WriteSeq: st.held.seq}
	if st.role == "slave" {
		ns.Following = st.masterHost + ":" + st.masterPort
	}
	redisstore.EachInfoField(info, func(k, v string) {
		switch k {
		case "used_memory":
			ns.UsedMemory, _ = strconv.ParseUint(v, 10, 64)
		case "maxmemory":
			ns.MaxMemory, _ = strconv.ParseUint(v, 10, 64)
		case "aof_rewrite_in_progress":
			ns.AOFRewriting = ns.AOFRewriting || v == "1"
		case "aof_rewrite_scheduled":
			ns.AOFRewriting = ns.AOFRewriting || v == "1"
		}
	})
	return ns
}
