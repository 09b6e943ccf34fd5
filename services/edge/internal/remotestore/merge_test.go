package remotestore

import (
	"testing"

	"github.com/stretchr/testify/require"

	commonv1 "github.com/keelmq/keel/proto/gen/keel/common/v1"
	persistencev1 "github.com/keelmq/keel/proto/gen/keel/persistence/v1"
)

// mergeOps joins a session's appends, and its completes, in a batch; any
// other write of the session, a different fence, and (for completes) a
// send in between keep ops apart; the ops given are never changed.
func TestMergeOps(t *testing.T) {
	key := func(c string) *commonv1.SessionKey { return &commonv1.SessionKey{Tenant: "acme", ClientId: c} }
	fence := func(e uint64) *persistencev1.Fence { return &persistencev1.Fence{Epoch: e} }
	app := func(c string, e uint64, seq uint64) *op {
		return &op{w: &persistencev1.WriteOp{Session: key(c), Fence: fence(e), Op: &persistencev1.WriteOp_Append{Append: &persistencev1.AppendOp{
			Entries:  []*persistencev1.Entry{{MsgId: &commonv1.MsgID{EdgeId: "e", Incarnation: 1, Seq: seq}}},
			Messages: []*commonv1.Message{{Id: &commonv1.MsgID{EdgeId: "e", Incarnation: 1, Seq: seq}}}}}}}
	}
	complete := func(c string, pk uint32) *op {
		return &op{w: &persistencev1.WriteOp{Session: key(c), Fence: fence(1), Op: &persistencev1.WriteOp_Complete{
			Complete: &persistencev1.CompleteOp{PacketIds: []uint32{pk}}}}}
	}
	send := func(c string) *op {
		return &op{w: &persistencev1.WriteOp{Session: key(c), Fence: fence(1), Op: &persistencev1.WriteOp_Send{Send: &persistencev1.SendOp{}}}}
	}
	sub := func(c string) *op {
		return &op{w: &persistencev1.WriteOp{Session: key(c), Fence: fence(1), Op: &persistencev1.WriteOp_PutSubscription{}}}
	}
	ops := []*op{
		app("a", 1, 1),   // 0 → ws 0
		app("b", 1, 2),   // 1 → ws 1
		complete("a", 9), // 2 → ws 2
		app("a", 1, 3),   // 3 → ws 0
		send("b"),        // 4 → ws 3
		complete("a", 8), // 5 → ws 4: a send came between
		app("a", 2, 4),   // 6 → ws 5: another fence
		sub("a"),         // 7 → ws 6
		app("a", 2, 5),   // 8 → ws 7: a subscription came between
		app("b", 1, 6),   // 9 → ws 8: b's send came between
	}
	ws, at := mergeOps(ops)
	require.Equal(t, []int{0, 1, 2, 0, 3, 4, 5, 6, 7, 8}, at)
	require.Len(t, ws, 9)
	var seqs []uint64
	for _, e := range ws[0].GetAppend().GetEntries() {
		seqs = append(seqs, e.GetMsgId().GetSeq())
	}
	require.Equal(t, []uint64{1, 3}, seqs)
	require.Len(t, ws[0].GetAppend().GetMessages(), 2)
	require.Len(t, ops[0].w.GetAppend().GetEntries(), 1, "the op given is not changed")
	require.Same(t, ops[1].w, ws[1], "an op merged with nothing goes as it is")
}

// An append held to the tenant's queue bound goes alone, so that a refusal
// (a count in its result) names its one entry, and a later append of the
// session does not join one made before it.
func TestMergeOps_TenantQuotaAppendsAlone(t *testing.T) {
	app := func(seq uint64, quota bool) *op {
		a := &persistencev1.AppendOp{
			Entries:  []*persistencev1.Entry{{MsgId: &commonv1.MsgID{EdgeId: "e", Incarnation: 1, Seq: seq}}},
			Messages: []*commonv1.Message{{Id: &commonv1.MsgID{EdgeId: "e", Incarnation: 1, Seq: seq}}}}
		if quota {
			a.Limits = &persistencev1.QueueLimits{TenantQuota: true}
		}
		return &op{w: &persistencev1.WriteOp{Session: &commonv1.SessionKey{Tenant: "acme", ClientId: "a"}, Fence: &persistencev1.Fence{Epoch: 1},
			Op: &persistencev1.WriteOp_Append{Append: a}}}
	}
	ws, at := mergeOps([]*op{app(1, false), app(2, true), app(3, true), app(4, false), app(5, false)})
	require.Equal(t, []int{0, 1, 2, 3, 3}, at)
	require.Len(t, ws, 4)
}
