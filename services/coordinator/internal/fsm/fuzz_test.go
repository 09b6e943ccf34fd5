package fsm

import (
	"testing"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// commandFixtures are valid entries of every command type, shared by the fuzz
// seeds and anything else that wants one of each.
func commandFixtures() map[CommandType]proto.Message {
	return map[CommandType]proto.Message{
		CmdClaimSessions: &raftpb.ClaimSessionsCommand{NowUnixNano: 1, Claims: []*raftpb.Claim{
			{EdgeId: "e1", Incarnation: 1, Tenant: "acme", ClientId: "c1", RequestId: "r"}}},
		CmdReleaseSession:   &raftpb.ReleaseSessionCommand{Tenant: "acme", ClientId: "c1", Epoch: 3, EdgeId: "e1", Incarnation: 1},
		CmdReassignSessions: &raftpb.ReassignSessionsCommand{FromEdgeId: "e1", Assignments: []*raftpb.Reassignment{{Tenant: "acme", ClientId: "c1", ToEdgeId: "e2"}}},
		CmdUpsertMember: &raftpb.UpsertMemberCommand{Member: &raftpb.MemberRecord{MemberId: "e1", Role: raftpb.MemberRole_MEMBER_ROLE_EDGE,
			Incarnation: 1, State: raftpb.MemberState_MEMBER_STATE_ALIVE}},
		CmdSetConfig:               &raftpb.SetConfigCommand{Set: []*raftpb.ConfigEntry{{Key: "k", Value: "v"}}},
		CmdBumpAclVersion:          &raftpb.BumpAclVersionCommand{Tenant: "acme"},
		CmdAcquirePromotionLease:   &raftpb.AcquirePromotionLeaseCommand{MemberId: "p", TtlNanos: 1e9},
		CmdCompareAndSetRedis:      &raftpb.CompareAndSetRedisPrimaryCommand{MemberId: "p", PrimaryAddress: "r:1"},
		CmdSetSlotTable:            &raftpb.SetSlotTableCommand{SlotGroups: []uint32{0}},
		CmdAcquirePromotionLeaseV2: &raftpb.AcquirePromotionLeaseCommand{MemberId: "p", TtlNanos: 1e9, FenceWriters: true},
		CmdReleaseSessions: &raftpb.ReleaseSessionsCommand{NowUnixNano: 1, Releases: []*raftpb.ReleaseSessionCommand{
			{Tenant: "acme", ClientId: "c1", Epoch: 3, EdgeId: "e1", Incarnation: 1, RequestId: "r"}}},
	}
}

// FuzzDecode feeds arbitrary entries to the decoder and, when they decode, to
// Apply: nothing may panic except on an undecodable entry, and a decodable one
// must apply deterministically (two FSMs end in the same state).
func FuzzDecode(f *testing.F) {
	for ct, m := range commandFixtures() {
		b, err := Encode(ct, m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{byte(IgnoreUnknownFlag | 99), 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		a, b := New(nil), New(nil)
		_, cmd, err := a.Decode(data)
		if err != nil || cmd == nil {
			return
		}
		for _, fs := range []*FSM{a, b} {
			// Seed a member so claims reach the interesting paths.
			seed, _ := Encode(CmdUpsertMember, commandFixtures()[CmdUpsertMember])
			fs.Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: seed})
			fs.Apply(&raft.Log{Index: 2, Type: raft.LogCommand, Data: data})
		}
		requireSameState(t, a.State(), b.State())
	})
}
