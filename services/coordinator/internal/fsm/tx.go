package fsm

import (
	"encoding/binary"

	iradix "github.com/hashicorp/go-immutable-radix/v2"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// Tx is a write transaction on the state, handed to command handlers. Its
// writes become visible together when the handler returns without error.
type Tx struct {
	base     *State
	txn      *iradix.Txn[any]
	index    uint64
	sessions int
	events   []Event
}

func newTx(base *State, index uint64) *Tx {
	return &Tx{base: base, txn: base.root.Txn(), index: index, sessions: base.sessions}
}

// Index returns the Raft index of the entry being applied.
func (tx *Tx) Index() uint64 { return tx.index }

func (tx *Tx) commit() *State {
	return &State{root: tx.txn.Commit(), index: tx.index, sessions: tx.sessions}
}

func (tx *Tx) get(k []byte) (any, bool) { return tx.txn.Get(k) }

func (tx *Tx) emit(e Event) {
	e.Index = tx.index
	tx.events = append(tx.events, e)
}

func (tx *Tx) session(tenant, clientID string) *raftpb.SessionRecord {
	v, ok := tx.get(sessionKey(tenant, clientID))
	if !ok {
		return nil
	}
	return v.(*raftpb.SessionRecord)
}

// putSession stores rec, keeping the owner index in step with prev (the record
// it replaces, or nil).
func (tx *Tx) putSession(prev, rec *raftpb.SessionRecord) {
	if prev != nil {
		tx.txn.Delete(ownerKey(prev.GetOwnerEdgeId(), prev.GetTenant(), prev.GetClientId()))
	} else {
		tx.sessions++
	}
	tx.txn.Insert(sessionKey(rec.GetTenant(), rec.GetClientId()), rec)
	tx.txn.Insert(ownerKey(rec.GetOwnerEdgeId(), rec.GetTenant(), rec.GetClientId()), present{})
}

func (tx *Tx) deleteSession(rec *raftpb.SessionRecord) {
	tx.txn.Delete(sessionKey(rec.GetTenant(), rec.GetClientId()))
	tx.txn.Delete(ownerKey(rec.GetOwnerEdgeId(), rec.GetTenant(), rec.GetClientId()))
	tx.sessions--
}

func (tx *Tx) member(id string) *raftpb.MemberRecord {
	v, ok := tx.get(memberKey(id))
	if !ok {
		return nil
	}
	return v.(*raftpb.MemberRecord)
}

func (tx *Tx) redisGroup(id uint32) *raftpb.RedisGroupRecord {
	v, ok := tx.get(redisKey(id))
	if !ok {
		return nil
	}
	return v.(*raftpb.RedisGroupRecord)
}

func (tx *Tx) meta() *raftpb.StateMeta {
	v, ok := tx.get(metaKey)
	if !ok {
		return &raftpb.StateMeta{}
	}
	return v.(*raftpb.StateMeta)
}

// DedupWindow is how long, in command time, the answer to an idempotent
// request is remembered. A client retrying longer than this after its first
// attempt may see the request applied twice.
const DedupWindow int64 = 5 * 60 * 1e9

// maxPrunePerApply bounds the expired request records one entry deletes, so
// that no single apply pays for a long backlog.
const maxPrunePerApply = 256

// lookupRequest returns the remembered answer for (scope, id) if id is set and
// the answer unmarshals into out.
func (tx *Tx) lookupRequest(scope, id string, out proto.Message) bool {
	if id == "" {
		return false
	}
	v, ok := tx.get(requestKey(scope, id))
	if !ok {
		return false
	}
	if err := proto.Unmarshal(v.(*raftpb.RequestRecord).GetResponse(), out); err != nil {
		return false
	}
	return true
}

// rememberRequest stores the answer for (scope, id), if id is set.
func (tx *Tx) rememberRequest(now int64, scope, id string, resp proto.Message) {
	if id == "" {
		return
	}
	b, err := marshalOpts.Marshal(resp)
	if err != nil {
		panic("fsm: marshal request record: " + err.Error())
	}
	exp := now + DedupWindow
	tx.txn.Insert(requestKey(scope, id), &raftpb.RequestRecord{Scope: scope, RequestId: id, ExpiresAtUnixNano: exp, Response: b})
	tx.txn.Insert(expiryKey(exp, scope, id), present{})
}

// pruneRequests deletes up to maxPrunePerApply request records that expired
// at now, oldest first.
func (tx *Tx) pruneRequests(now int64) {
	var expired [][]byte
	it := tx.txn.Root().Iterator()
	it.SeekPrefix([]byte{prefixExpiry})
	for k, _, ok := it.Next(); ok && len(expired) < maxPrunePerApply; k, _, ok = it.Next() {
		if int64(binary.BigEndian.Uint64(k[1:9])) > now {
			break
		}
		expired = append(expired, k)
	}
	for _, k := range expired {
		rest := k[9:]
		n := int(rest[0])
		tx.txn.Delete(requestKey(string(rest[1:1+n]), string(rest[1+n:])))
		tx.txn.Delete(k)
	}
}
