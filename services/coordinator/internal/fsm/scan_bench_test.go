package fsm

import (
	"fmt"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// BenchmarkState_ScanSessions reads every session of a state holding
// 200,000, as a new leader does once to find the custodians of dead edges'
// sessions (ns/op is per session).
func BenchmarkState_ScanSessions(b *testing.B) {
	const sessions = 200_000
	f := New(testutil.Logger(b))
	index := uint64(0)
	data, err := Encode(CmdUpsertMember, &raftpb.UpsertMemberCommand{NowUnixNano: 1, Member: &raftpb.MemberRecord{
		MemberId: "e1", Role: raftpb.MemberRole_MEMBER_ROLE_EDGE, Incarnation: 1, Address: "http://e1",
		State: raftpb.MemberState_MEMBER_STATE_ALIVE}})
	require.NoError(b, err)
	index++
	f.Apply(&raft.Log{Index: index, Term: 1, Type: raft.LogCommand, Data: data})
	for start := 0; start < sessions; start += 4096 {
		cmd := &raftpb.ClaimSessionsCommand{NowUnixNano: 1}
		for i := start; i < min(start+4096, sessions); i++ {
			cmd.Claims = append(cmd.Claims, &raftpb.Claim{EdgeId: "e1", Incarnation: 1, Tenant: "acme",
				ClientId: fmt.Sprintf("device-%07d", i), RequestId: fmt.Sprintf("r%d", i)})
		}
		data, err := Encode(CmdClaimSessions, cmd)
		require.NoError(b, err)
		index++
		f.Apply(&raft.Log{Index: index, Term: 1, Type: raft.LogCommand, Data: data})
	}
	st := f.State()
	b.ResetTimer()
	for range b.N / sessions {
		n := 0
		st.ScanSessions(SessionScan{}, func(rec *raftpb.SessionRecord, _ bool) bool {
			if rec.GetOwnerKind() == raftpb.OwnerKind_OWNER_KIND_CUSTODY {
				n++
			}
			return true
		})
	}
}
