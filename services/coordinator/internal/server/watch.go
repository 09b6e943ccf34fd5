package server

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/keelmq/keel/services/coordinator/internal/fsm"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	coordinatorv1 "github.com/keelmq/keel/proto/gen/keel/coordinator/v1"
)

// hubCapacity is how many events the hub keeps for resuming watchers; one
// that falls further behind gets a fresh snapshot.
const hubCapacity = 8192

type hubEvent struct {
	index uint64
	ev    fsm.Event
}

// hub fans the FSM's events out to WatchCluster streams on this node.
type hub struct {
	mu        sync.Mutex
	events    []hubEvent    // guarded by mu; ascending index
	coverFrom uint64        // guarded by mu; events are complete for indexes > coverFrom
	changed   chan struct{} // guarded by mu; closed on publish
}

func newHub(f *fsm.FSM) *hub {
	return &hub{coverFrom: f.State().Index(), changed: make(chan struct{})}
}

// publish adds the events of one entry; nil events mean a snapshot was
// restored at index, so nothing at or below it can be replayed.
func (h *hub) publish(index uint64, events []fsm.Event) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if events == nil {
		h.events = nil
		h.coverFrom = index
	}
	for _, e := range events {
		h.events = append(h.events, hubEvent{index: index, ev: e})
	}
	if over := len(h.events) - hubCapacity; over > 0 {
		h.coverFrom = h.events[over-1].index
		h.events = append([]hubEvent(nil), h.events[over:]...)
	}
	close(h.changed)
	h.changed = make(chan struct{})
}

// since returns the events after index from, whether the watcher missed some
// (gap), and a channel closed at the next publish.
func (h *hub) since(from uint64) (out []hubEvent, gap bool, changed <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if from < h.coverFrom {
		return nil, true, h.changed
	}
	i := len(h.events)
	for i > 0 && h.events[i-1].index > from {
		i--
	}
	return append([]hubEvent(nil), h.events[i:]...), false, h.changed
}

// WatchCluster streams a snapshot and then every relevant change; see the
// proto for the contract. Any node serves it from its own FSM.
func (s *Server) WatchCluster(ctx context.Context, req *connect.Request[coordinatorv1.WatchClusterRequest], stream *connect.ServerStream[coordinatorv1.WatchClusterResponse]) error {
	m := req.Msg
	if err := fsm.CheckMemberID(m.GetMemberId()); err != nil {
		return s.toConnect(err)
	}
	if m.GetRole() == coordinatorv1.MemberRole_MEMBER_ROLE_UNSPECIFIED {
		return invalid("role is required")
	}
	from := m.GetFromIndex()
	needSnapshot := from == 0
	hb := time.NewTicker(s.cfg.WatchHeartbeat)
	defer hb.Stop()
	for {
		events, gap, changed := s.hub.since(from)
		if needSnapshot || gap || from > s.fsm.State().Index() {
			st := s.fsm.State()
			snap := s.clusterSnapshot(st)
			if m.GetRole() == coordinatorv1.MemberRole_MEMBER_ROLE_EDGE {
				snap.Custody = custodyOf(st, m.GetMemberId(), m.GetIncarnation())
			}
			if err := stream.Send(&coordinatorv1.WatchClusterResponse{Index: st.Index(),
				Event: &coordinatorv1.WatchClusterResponse_Snapshot{Snapshot: snap}}); err != nil {
				return err
			}
			from, needSnapshot = st.Index(), false
			continue
		}
		for _, e := range events {
			msg := s.watchEvent(e, m.GetMemberId())
			if msg != nil {
				if err := stream.Send(msg); err != nil {
					return err
				}
			}
			from = e.index
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-hb.C:
			id, _ := s.node.Leader()
			term, _ := strconv.ParseUint(s.node.Raft().Stats()["term"], 10, 64)
			if err := stream.Send(&coordinatorv1.WatchClusterResponse{Index: from,
				Event: &coordinatorv1.WatchClusterResponse_Heartbeat{Heartbeat: &coordinatorv1.ClusterHeartbeat{LeaderId: id, Term: term}}}); err != nil {
				return err
			}
		}
	}
}

func (s *Server) watchEvent(e hubEvent, member string) *coordinatorv1.WatchClusterResponse {
	out := &coordinatorv1.WatchClusterResponse{Index: e.index}
	ev := e.ev
	switch ev.Kind {
	case fsm.EventMember:
		out.Event = &coordinatorv1.WatchClusterResponse_Membership{Membership: &coordinatorv1.MembershipChange{Member: toMember(ev.Member)}}
	case fsm.EventConfig, fsm.EventSlotTable:
		out.Event = &coordinatorv1.WatchClusterResponse_Config{Config: s.clusterConfig(s.fsm.State())}
	case fsm.EventACL:
		out.Event = &coordinatorv1.WatchClusterResponse_AclVersion{AclVersion: &coordinatorv1.AclVersionChange{
			Tenant: ev.ACL.GetTenant(), Version: ev.ACL.GetVersion()}}
	case fsm.EventRedisGroup:
		out.Event = &coordinatorv1.WatchClusterResponse_RedisGroup{RedisGroup: toRedisGroup(ev.RedisGroup)}
	case fsm.EventCustody:
		if ev.ToEdge != member {
			return nil
		}
		out.Event = &coordinatorv1.WatchClusterResponse_Custody{Custody: &coordinatorv1.CustodyAssignment{
			FromEdgeId: ev.FromEdge, FromIncarnation: ev.FromIncarnation, ToEdgeId: ev.ToEdge, Sessions: toSessionEpochs(ev.Sessions)}}
	case fsm.EventTakeover:
		if ev.FromEdge != member {
			return nil
		}
		out.Event = &coordinatorv1.WatchClusterResponse_Takeover{Takeover: &coordinatorv1.SessionTakeover{
			NewOwnerEdgeId: ev.ToEdge, NewOwnerIncarnation: ev.ToIncarnation, Sessions: toSessionEpochs(ev.Sessions)}}
	default:
		return nil
	}
	return out
}

// custodyOf lists the sessions edge holds in custody under incarnation:
// those a watch snapshot hands it again, in case it missed their
// assignment.
func custodyOf(st *fsm.State, edge string, incarnation uint64) []*coordinatorv1.SessionEpoch {
	var out []*coordinatorv1.SessionEpoch
	st.SessionsOwnedBy(edge, func(r *raftpb.SessionRecord) bool {
		if r.GetOwnerKind() == raftpb.OwnerKind_OWNER_KIND_CUSTODY && r.GetOwnerIncarnation() == incarnation {
			out = append(out, &coordinatorv1.SessionEpoch{Session: &commonv1.SessionKey{Tenant: r.GetTenant(), ClientId: r.GetClientId()},
				Epoch: r.GetEpoch()})
		}
		return true
	})
	return out
}

func (s *Server) clusterSnapshot(st *fsm.State) *coordinatorv1.ClusterSnapshot {
	snap := &coordinatorv1.ClusterSnapshot{Config: s.clusterConfig(st)}
	for _, m := range st.Members() {
		if m.GetState() == raftpb.MemberState_MEMBER_STATE_ALIVE || m.GetState() == raftpb.MemberState_MEMBER_STATE_DRAINING {
			snap.Members = append(snap.Members, toMember(m))
		}
	}
	for _, a := range st.ACLVersions() {
		snap.AclVersions = append(snap.AclVersions, &coordinatorv1.AclVersionChange{Tenant: a.GetTenant(), Version: a.GetVersion()})
	}
	for _, g := range st.RedisGroups() {
		snap.RedisGroups = append(snap.RedisGroups, toRedisGroup(g))
	}
	return snap
}

// Cluster config keys understood in the replicated key-value config.
const (
	ConfigRouteCacheLease   = "route_cache_lease"
	ConfigForwardRetryBound = "forward_retry_bound"
	ConfigRedisGroupCount   = "redis_group_count"
	ConfigAllowNoReplicas   = "allow_no_replicas"
)

func (s *Server) clusterConfig(st *fsm.State) *coordinatorv1.ClusterConfig {
	dur := func(k string, def time.Duration) *durationpb.Duration {
		if v, ok := st.ConfigValue(k); ok {
			if d, err := time.ParseDuration(v); err == nil {
				return durationpb.New(d)
			}
		}
		return durationpb.New(def)
	}
	c := &coordinatorv1.ClusterConfig{
		Version:           st.ConfigVersion(),
		LeaseTtl:          durationpb.New(s.cfg.LeaseTTL),
		RouteCacheLease:   dur(ConfigRouteCacheLease, 2*time.Second),
		ForwardRetryBound: dur(ConfigForwardRetryBound, 30*time.Second),
		RedisGroupCount:   1,
		SlotGroups:        st.SlotTable().GetSlotGroups(),
	}
	// K is the slot table's, once one is installed: it is fixed then.
	if len(c.SlotGroups) > 0 {
		c.RedisGroupCount = slices.Max(c.SlotGroups) + 1
	} else if v, ok := st.ConfigValue(ConfigRedisGroupCount); ok {
		if n, err := strconv.ParseUint(v, 10, 32); err == nil {
			c.RedisGroupCount = uint32(n)
		}
	}
	if v, ok := st.ConfigValue(ConfigAllowNoReplicas); ok {
		c.AllowNoReplicas, _ = strconv.ParseBool(v)
	}
	return c
}

func toMember(m *raftpb.MemberRecord) *coordinatorv1.Member {
	return &coordinatorv1.Member{MemberId: m.GetMemberId(), Role: coordinatorv1.MemberRole(m.GetRole()),
		Incarnation: m.GetIncarnation(), Address: m.GetAddress(), State: coordinatorv1.MemberState(m.GetState())}
}

func toRedisGroup(g *raftpb.RedisGroupRecord) *coordinatorv1.RedisGroupRecord {
	if g == nil {
		return nil
	}
	out := &coordinatorv1.RedisGroupRecord{GroupId: g.GetGroupId(), RecordEpoch: g.GetRecordEpoch(),
		PrimaryAddress: g.GetPrimaryAddress(), ReplicaAddresses: g.GetReplicaAddresses()}
	if g.GetUpdatedAtUnixNano() != 0 {
		out.UpdatedAt = timestamppb.New(time.Unix(0, g.GetUpdatedAtUnixNano()))
	}
	return out
}

func toSessionRecord(r *raftpb.SessionRecord) *coordinatorv1.SessionRecord {
	if r == nil {
		return nil
	}
	return &coordinatorv1.SessionRecord{
		Session:          &commonv1.SessionKey{Tenant: r.GetTenant(), ClientId: r.GetClientId()},
		Epoch:            r.GetEpoch(),
		OwnerEdgeId:      r.GetOwnerEdgeId(),
		OwnerIncarnation: r.GetOwnerIncarnation(),
		OwnerKind:        coordinatorv1.SessionOwnerKind(r.GetOwnerKind()),
		GrantedAt:        timestamppb.New(time.Unix(0, r.GetGrantedAtUnixNano())),
		TakenFromEdgeId:  r.GetTakenFromEdgeId(),
	}
}

func toSessionEpochs(in []fsm.SessionEpoch) []*coordinatorv1.SessionEpoch {
	out := make([]*coordinatorv1.SessionEpoch, len(in))
	for i, s := range in {
		out[i] = &coordinatorv1.SessionEpoch{Session: &commonv1.SessionKey{Tenant: s.Tenant, ClientId: s.ClientID}, Epoch: s.Epoch}
	}
	return out
}
