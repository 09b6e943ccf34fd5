package boltstore

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"strconv"

	bolt "go.etcd.io/bbolt"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// apply applies o in tx. A refusal found before o wrote anything (bad
// input, fenced) is the result's Err, and the transaction goes on; the
// error returned is a failure after o may have written part of itself,
// which the caller must roll back (bbolt has no savepoints). Every op is
// written check first, then write, so refusals never take that path.
func apply(tx *bolt.Tx, o *store.Op) (r store.OpResult, err error) {
	defer func() {
		if p := recover(); p != nil {
			r, err = store.OpResult{}, fmt.Errorf("boltstore: %s panicked: %v", o.Kind, p)
		}
	}()
	switch o.Kind {
	case store.OpActivate:
		return activate(tx, o)
	case store.OpPutSession:
		return putSession(tx, o)
	case store.OpDeleteSession:
		return deleteSession(tx, o)
	case store.OpPutSubscription:
		return putSubscription(tx, o)
	case store.OpDeleteSubscription:
		return deleteSubscription(tx, o)
	case store.OpAppend:
		return appendEntries(tx, o)
	case store.OpSend:
		return send(tx, o)
	case store.OpPubrel:
		return pubrel(tx, o)
	case store.OpComplete:
		return complete(tx, o)
	case store.OpDequeue:
		return dequeue(tx, o)
	case store.OpPutIncoming:
		return putIncoming(tx, o)
	case store.OpDeleteIncoming:
		return deleteIncoming(tx, o)
	case store.OpPutRetained:
		return putRetained(tx, o)
	}
	return refused(fmt.Errorf("%w: unknown op kind %d", store.ErrInvalid, o.Kind))
}

func refused(err error) (store.OpResult, error) { return store.OpResult{Err: err}, nil }

type sess struct {
	b                   *bolt.Bucket
	sub, q, qe, inf, in *bolt.Bucket
}

// session checks the key and the fence, then opens (creating) the
// session's buckets. A refusal comes back as fail, before anything is
// written; err is a failure after session may have created buckets. ss is
// nil exactly when either is set.
func session(tx *bolt.Tx, k store.SessionKey, f *store.Fence) (ss *sess, fail, err error) {
	b, fail := check(tx, k, f)
	if fail != nil {
		return nil, fail, nil
	}
	ss, err = openSession(tx, k, b)
	return ss, nil, err
}

// check validates k and f, writing nothing. It returns the session's
// bucket, nil when there is none yet (epoch 0, which fences nothing).
func check(tx *bolt.Tx, k store.SessionKey, f *store.Fence) (*bolt.Bucket, error) {
	if err := k.Validate(); err != nil {
		return nil, err
	}
	b := tx.Bucket(bSessions).Bucket([]byte(k.Tag()))
	if b != nil {
		if cur := u64(b.Get(kEpoch)); f.Epoch < cur {
			return nil, fmt.Errorf("%w: epoch %d < %d", store.ErrFenced, f.Epoch, cur)
		}
	}
	return b, nil
}

// openSession opens the session's buckets, creating those missing (b is
// its bucket as [check] found it).
func openSession(tx *bolt.Tx, k store.SessionKey, b *bolt.Bucket) (*sess, error) {
	var err error
	if b == nil {
		if b, err = tx.Bucket(bSessions).CreateBucket([]byte(k.Tag())); err != nil {
			return nil, err
		}
	}
	ss := &sess{b: b}
	for i, bp := range [...]**bolt.Bucket{&ss.sub, &ss.q, &ss.qe, &ss.inf, &ss.in} {
		if *bp = b.Bucket(subNames[i]); *bp == nil {
			if *bp, err = b.CreateBucket(subNames[i]); err != nil {
				return nil, err
			}
		}
	}
	return ss, nil
}

// keyFits refuses a key bbolt would refuse, before anything is written.
func keyFits(what, key string) error {
	if len(key) > bolt.MaxKeySize {
		return fmt.Errorf("%w: %s longer than %d bytes", store.ErrInvalid, what, bolt.MaxKeySize)
	}
	return nil
}

// queueLen counts the queue's entries. bbolt's bucket statistics do not see
// the writes of the transaction in progress, so count with a cursor; queues
// are bounded, and an append counts once, however many entries it has.
func queueLen(q *bolt.Bucket) int {
	n := 0
	c := q.Cursor()
	for k, _ := c.First(); k != nil; k, _ = c.Next() {
		n++
	}
	return n
}

func u64(b []byte) uint64 {
	if len(b) != 8 {
		return 0
	}
	return binary.BigEndian.Uint64(b)
}

func be(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// tenantQueued returns tenant's count of queued entries.
func tenantQueued(tx *bolt.Tx, tenant string) int {
	return int(u64(tx.Bucket(bTenantQueued).Get([]byte(tenant))))
}

// countQueued adds n to tenant's count of queued entries; the count never
// goes below 0 (one from before it was kept) and is deleted at 0.
func countQueued(tx *bolt.Tx, tenant string, n int) error {
	if n == 0 {
		return nil
	}
	b := tx.Bucket(bTenantQueued)
	v := tenantQueued(tx, tenant) + n
	if v <= 0 {
		return b.Delete([]byte(tenant))
	}
	return b.Put([]byte(tenant), be(uint64(v)))
}

func pk(p uint16) []byte { return binary.BigEndian.AppendUint16(nil, p) }

func ref(tx *bolt.Tx, m *store.Message) error {
	b := tx.Bucket(bMsgs)
	var rec struct {
		M *store.Message `json:"m"`
		N int            `json:"n"`
	}
	if v := b.Get([]byte(m.ID)); v != nil {
		if err := json.Unmarshal(v, &rec); err != nil {
			return err
		}
	} else {
		rec.M = m
	}
	rec.N++
	v, _ := json.Marshal(&rec)
	return b.Put([]byte(m.ID), v)
}

func refExisting(tx *bolt.Tx, id string) (bool, error) {
	b := tx.Bucket(bMsgs)
	v := b.Get([]byte(id))
	if v == nil {
		return false, nil
	}
	var rec map[string]json.RawMessage
	if err := json.Unmarshal(v, &rec); err != nil {
		return false, err
	}
	n, _ := strconv.Atoi(string(rec["n"]))
	rec["n"] = json.RawMessage(strconv.Itoa(n + 1))
	nv, _ := json.Marshal(rec)
	return true, b.Put([]byte(id), nv)
}

func unref(tx *bolt.Tx, id string) error {
	b := tx.Bucket(bMsgs)
	v := b.Get([]byte(id))
	if v == nil {
		return nil
	}
	var rec map[string]json.RawMessage
	if err := json.Unmarshal(v, &rec); err != nil {
		return err
	}
	n, _ := strconv.Atoi(string(rec["n"]))
	if n <= 1 {
		return b.Delete([]byte(id))
	}
	rec["n"] = json.RawMessage(strconv.Itoa(n - 1))
	nv, _ := json.Marshal(rec)
	return b.Put([]byte(id), nv)
}

func loadMsg(tx *bolt.Tx, id string) *store.Message {
	v := tx.Bucket(bMsgs).Get([]byte(id))
	if v == nil {
		return nil
	}
	var rec struct {
		M *store.Message `json:"m"`
	}
	if json.Unmarshal(v, &rec) != nil {
		return nil
	}
	return rec.M
}

func activate(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	return store.OpResult{}, ss.b.Put(kEpoch, be(o.Fence.Epoch))
}

func putSession(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	v, _ := json.Marshal(&o.Session)
	return store.OpResult{}, ss.b.Put(kRec, v)
}

func deleteSession(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	if err := countQueued(tx, o.Key.Tenant, -queueLen(ss.q)); err != nil {
		return store.OpResult{}, err
	}
	if err := ss.qe.ForEach(func(id, _ []byte) error { return unref(tx, string(id)) }); err != nil {
		return store.OpResult{}, err
	}
	if err := ss.inf.ForEach(func(_, v []byte) error {
		var e store.Entry
		if err := json.Unmarshal(v, &e); err != nil {
			return err
		}
		return unref(tx, e.MsgID)
	}); err != nil {
		return store.OpResult{}, err
	}
	for _, n := range subNames {
		if err := ss.b.DeleteBucket(n); err != nil {
			return store.OpResult{}, err
		}
	}
	if ss.b.Bucket(bTook) != nil {
		if err := ss.b.DeleteBucket(bTook); err != nil {
			return store.OpResult{}, err
		}
	}
	if err := ss.b.Delete(kRec); err != nil {
		return store.OpResult{}, err
	}
	return store.OpResult{}, ss.b.Delete(kSeq)
}

func putSubscription(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	if o.Sub.Filter == "" {
		return refused(fmt.Errorf("%w: empty filter", store.ErrInvalid))
	}
	if err := keyFits("filter", o.Sub.Filter); err != nil {
		return refused(err)
	}
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	v, _ := json.Marshal(&o.Sub)
	return store.OpResult{}, ss.sub.Put([]byte(o.Sub.Filter), v)
}

func deleteSubscription(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	return store.OpResult{}, ss.sub.Delete([]byte(o.Filter))
}

func appendEntries(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	entries, msgs, lim := o.Entries, o.Messages, o.Limits
	if len(entries) != len(msgs) {
		return refused(fmt.Errorf("%w: %d entries, %d messages", store.ErrInvalid, len(entries), len(msgs)))
	}
	for i, e := range entries {
		if msgs[i] == nil || msgs[i].ID == "" || msgs[i].ID != e.MsgID {
			return refused(fmt.Errorf("%w: entry %d: message ID mismatch", store.ErrInvalid, i))
		}
		if err := keyFits("message ID", e.MsgID); err != nil {
			return refused(err)
		}
	}
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	var res store.AppendResult
	var took tookList
	qlen := -1 // counted on first need, then kept up to date
	tcount, tdelta := 0, 0
	if lim.TenantMax > 0 {
		tcount = tenantQueued(tx, o.Key.Tenant)
	}
	for i, e := range entries {
		if ss.qe.Get([]byte(e.MsgID)) != nil {
			res.Duplicates++
			if e.TookQoS2 {
				if err := took.remember(ss.b, e.MsgID, true); err != nil {
					return store.OpResult{}, err
				}
			}
			continue
		}
		if lim.MaxLen > 0 || lim.TenantMax > 0 {
			if qlen < 0 {
				qlen = queueLen(ss.q)
			}
			made := false
			if lim.MaxLen > 0 && qlen >= lim.MaxLen {
				if !lim.DropOldest {
					res.Refused++
					continue
				}
				ck, cv := ss.q.Cursor().First()
				if ck != nil {
					id := string(cv)
					if err := ss.q.Delete(ck); err != nil {
						return store.OpResult{}, err
					}
					if err := ss.qe.Delete([]byte(id)); err != nil {
						return store.OpResult{}, err
					}
					if err := unref(tx, id); err != nil {
						return store.OpResult{}, err
					}
					qlen--
					tdelta--
					res.DroppedOldest++
					made = true
				}
			}
			// The tenant's bound refuses the newest: which of its sessions
			// should lose an entry instead is not this call's to choose. An
			// entry the session's own drop made room for leaves the count
			// as it was, and is not refused after the drop.
			if !made && lim.TenantMax > 0 && tcount+tdelta >= lim.TenantMax {
				res.Refused++
				continue
			}
		}
		seq := u64(ss.b.Get(kSeq)) + 1
		if err := ss.b.Put(kSeq, be(seq)); err != nil {
			return store.OpResult{}, err
		}
		e.Seq = seq
		v, _ := json.Marshal(&e)
		if err := ss.q.Put(be(seq), []byte(e.MsgID)); err != nil {
			return store.OpResult{}, err
		}
		if err := ss.qe.Put([]byte(e.MsgID), v); err != nil {
			return store.OpResult{}, err
		}
		if err := ref(tx, msgs[i]); err != nil {
			return store.OpResult{}, err
		}
		if qlen >= 0 {
			qlen++
		}
		tdelta++
		res.Added++
		if e.TookQoS2 {
			if err := took.remember(ss.b, e.MsgID, false); err != nil {
				return store.OpResult{}, err
			}
		}
	}
	return store.OpResult{Append: res}, countQueued(tx, o.Key.Tenant, tdelta)
}

// tookList records an append's entries marked [store.Entry.TookQoS2] in
// the session's bTook bucket, as the Redis store does: an entry found
// queued already (a retry) is recorded only if the list lacks it, which
// is read once per append, and only then; a fresh one without looking.
type tookList struct {
	b      *bolt.Bucket
	listed map[string]bool
}

func (t *tookList) remember(session *bolt.Bucket, msgID string, dup bool) error {
	if t.b == nil {
		var err error
		if t.b, err = session.CreateBucketIfNotExists(bTook); err != nil {
			return err
		}
	}
	if dup {
		if t.listed == nil {
			t.listed = map[string]bool{}
			if err := t.b.ForEach(func(_, v []byte) error { t.listed[string(v)] = true; return nil }); err != nil {
				return err
			}
		}
		if t.listed[msgID] {
			return nil
		}
	}
	if t.listed != nil {
		t.listed[msgID] = true
	}
	n, err := t.b.NextSequence()
	if err != nil {
		return err
	}
	if err := t.b.Put(be(n), []byte(msgID)); err != nil {
		return err
	}
	if n > store.TookQoS2Len {
		return t.b.Delete(be(n - store.TookQoS2Len))
	}
	return nil
}

func send(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	b, fail := check(tx, o.Key, &o.Fence)
	if fail != nil {
		return refused(fail)
	}
	// Refuse a delivery of a message stored nowhere before writing. The
	// references that go (a QoS 0 copy leaving the queue, an entry replaced
	// at its packet ID) go after every new one is taken, so the loop below
	// finds every message this check found.
	var qe *bolt.Bucket
	if b != nil {
		qe = b.Bucket(subNames[2])
	}
	msgs := tx.Bucket(bMsgs)
	for _, e := range o.Entries {
		if e.QoS != 0 && (qe == nil || qe.Get([]byte(e.MsgID)) == nil) && msgs.Get([]byte(e.MsgID)) == nil {
			return refused(fmt.Errorf("%w: message %s is not stored", store.ErrInvalid, e.MsgID))
		}
	}
	ss, err := openSession(tx, o.Key, b)
	if err != nil {
		return store.OpResult{}, err
	}
	var release []string
	dequeued := 0
	for _, e := range o.Entries {
		queued := false
		if v := ss.qe.Get([]byte(e.MsgID)); v != nil {
			var qe store.Entry
			if err := json.Unmarshal(v, &qe); err != nil {
				return store.OpResult{}, err
			}
			if err := ss.q.Delete(be(qe.Seq)); err != nil {
				return store.OpResult{}, err
			}
			if err := ss.qe.Delete([]byte(e.MsgID)); err != nil {
				return store.OpResult{}, err
			}
			queued = true
			dequeued++
		}
		if e.QoS == 0 {
			if queued {
				release = append(release, e.MsgID)
			}
			continue
		}
		if !queued {
			ok, err := refExisting(tx, e.MsgID)
			if err != nil {
				return store.OpResult{}, err
			}
			if !ok {
				return store.OpResult{}, fmt.Errorf("%w: message %s is not stored", store.ErrInvalid, e.MsgID)
			}
		}
		if old := ss.inf.Get(pk(e.PacketID)); old != nil {
			var oe store.Entry
			if json.Unmarshal(old, &oe) == nil {
				release = append(release, oe.MsgID)
			}
		}
		v, _ := json.Marshal(&e)
		if err := ss.inf.Put(pk(e.PacketID), v); err != nil {
			return store.OpResult{}, err
		}
	}
	for _, id := range release {
		if err := unref(tx, id); err != nil {
			return store.OpResult{}, err
		}
	}
	return store.OpResult{}, countQueued(tx, o.Key.Tenant, -dequeued)
}

func pubrel(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	v := ss.inf.Get(pk(o.PacketID))
	if v == nil {
		return store.OpResult{}, nil
	}
	var e store.Entry
	if err := json.Unmarshal(v, &e); err != nil {
		return store.OpResult{}, err
	}
	e.Pubrel = true
	nv, _ := json.Marshal(&e)
	return store.OpResult{}, ss.inf.Put(pk(o.PacketID), nv)
}

func complete(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	for _, p := range o.PacketIDs {
		v := ss.inf.Get(pk(p))
		if v == nil {
			continue
		}
		var e store.Entry
		if err := json.Unmarshal(v, &e); err != nil {
			return store.OpResult{}, err
		}
		if err := ss.inf.Delete(pk(p)); err != nil {
			return store.OpResult{}, err
		}
		if err := unref(tx, e.MsgID); err != nil {
			return store.OpResult{}, err
		}
	}
	return store.OpResult{}, nil
}

func dequeue(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	n := 0
	for _, id := range o.MsgIDs {
		v := ss.qe.Get([]byte(id))
		if v == nil {
			continue
		}
		var e store.Entry
		if err := json.Unmarshal(v, &e); err != nil {
			return store.OpResult{}, err
		}
		if err := ss.q.Delete(be(e.Seq)); err != nil {
			return store.OpResult{}, err
		}
		if err := ss.qe.Delete([]byte(id)); err != nil {
			return store.OpResult{}, err
		}
		if err := unref(tx, id); err != nil {
			return store.OpResult{}, err
		}
		n++
	}
	return store.OpResult{}, countQueued(tx, o.Key.Tenant, -n)
}

func putIncoming(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	return store.OpResult{}, ss.in.Put(pk(o.Incoming.PacketID), []byte(o.Incoming.MsgID))
}

func deleteIncoming(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	ss, fail, err := session(tx, o.Key, &o.Fence)
	if ss == nil {
		return store.OpResult{Err: fail}, err
	}
	return store.OpResult{}, ss.in.Delete(pk(o.PacketID))
}

func putRetained(tx *bolt.Tx, o *store.Op) (store.OpResult, error) {
	tenant, m := o.Tenant, o.Retained
	if tenant == "" || m == nil || m.Topic == "" {
		return refused(fmt.Errorf("%w: tenant and topic are required", store.ErrInvalid))
	}
	if err := keyFits("topic", m.Topic); err != nil {
		return refused(err)
	}
	key := []byte(m.Topic)
	if tb := tx.Bucket(bRetained).Bucket([]byte(tenant)); tb != nil {
		if v := tb.Get(key); v != nil {
			var old store.Message
			if json.Unmarshal(v, &old) == nil && old.Created > m.Created {
				return store.OpResult{}, nil
			}
			if len(m.Payload) == 0 {
				return store.OpResult{Changed: true}, tb.Delete(key)
			}
		}
	}
	if len(m.Payload) == 0 {
		return store.OpResult{}, nil // nothing to delete
	}
	b, err := tx.Bucket(bRetained).CreateBucketIfNotExists([]byte(tenant))
	if err != nil {
		return store.OpResult{}, err
	}
	v, _ := json.Marshal(m)
	return store.OpResult{Changed: true}, b.Put(key, v)
}
