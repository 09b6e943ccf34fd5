// Package boltstore implements the persistence store on a local bbolt file,
// for a single-node Keel (`make run`). It keeps the same contract as the
// Redis store; there is nothing to replicate, so every write is durable once
// its transaction commits.
package boltstore

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// Store is a [store.Store] on bbolt. Sessions are buckets named by their
// hash tag, holding the sub-buckets below; messages and retained messages
// have buckets of their own.
type Store struct {
	db *bolt.DB
}

var (
	bMsgs     = []byte("msgs")
	bRetained = []byte("retained")
	bSessions = []byte("sessions")
	kEpoch    = []byte("epoch")
	kRec      = []byte("rec")
	kSeq      = []byte("seq")
	subNames  = [][]byte{[]byte("sub"), []byte("q"), []byte("qe"), []byte("inf"), []byte("in")}
)

// Open opens (creating) the store file in dir.
func Open(dir string) (*Store, error) {
	db, err := bolt.Open(filepath.Join(dir, "persistence.db"), 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, err
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bMsgs, bRetained, bSessions} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		_ = db.Close()
		return nil, err
	}
	return &Store{db: db}, nil
}

// Close closes the file.
func (s *Store) Close() error { return s.db.Close() }

type sess struct {
	b                   *bolt.Bucket
	sub, q, qe, inf, in *bolt.Bucket
}

// session opens (creating) the session's buckets and checks the fence.
func session(tx *bolt.Tx, k store.SessionKey, f *store.Fence) (*sess, error) {
	if err := k.Validate(); err != nil {
		return nil, err
	}
	root := tx.Bucket(bSessions)
	b, err := root.CreateBucketIfNotExists([]byte(k.Tag()))
	if err != nil {
		return nil, err
	}
	if f != nil {
		if cur := u64(b.Get(kEpoch)); f.Epoch < cur {
			return nil, fmt.Errorf("%w: epoch %d < %d", store.ErrFenced, f.Epoch, cur)
		}
	}
	s := &sess{b: b}
	bs := make([]*bolt.Bucket, len(subNames))
	for i, n := range subNames {
		if bs[i], err = b.CreateBucketIfNotExists(n); err != nil {
			return nil, err
		}
	}
	s.sub, s.q, s.qe, s.inf, s.in = bs[0], bs[1], bs[2], bs[3], bs[4]
	return s, nil
}

// queueLen counts the queue's entries. bbolt's bucket statistics do not see
// the writes of the transaction in progress, so count with a cursor; queues
// are bounded, and the single-node store is not the hot path of a cluster.
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

func pk(p uint16) []byte { return binary.BigEndian.AppendUint16(nil, p) }

func (s *Store) update(fn func(tx *bolt.Tx) error) error { return s.db.Update(fn) }

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

// Activate implements [store.Store].
func (s *Store) Activate(_ context.Context, k store.SessionKey, f store.Fence) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		return ss.b.Put(kEpoch, be(f.Epoch))
	})
}

// PutSession implements [store.Store].
func (s *Store) PutSession(_ context.Context, k store.SessionKey, f store.Fence, rec store.Session) error {
	v, _ := json.Marshal(&rec)
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		return ss.b.Put(kRec, v)
	})
}

// DeleteSession implements [store.Store].
func (s *Store) DeleteSession(_ context.Context, k store.SessionKey, f store.Fence) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		if err := ss.qe.ForEach(func(id, _ []byte) error { return unref(tx, string(id)) }); err != nil {
			return err
		}
		if err := ss.inf.ForEach(func(_, v []byte) error {
			var e store.Entry
			if err := json.Unmarshal(v, &e); err != nil {
				return err
			}
			return unref(tx, e.MsgID)
		}); err != nil {
			return err
		}
		for _, n := range subNames {
			if err := ss.b.DeleteBucket(n); err != nil {
				return err
			}
		}
		_ = ss.b.Delete(kRec)
		return ss.b.Delete(kSeq)
	})
}

// PutSubscription implements [store.Store].
func (s *Store) PutSubscription(_ context.Context, k store.SessionKey, f store.Fence, sub store.Subscription) error {
	if sub.Filter == "" {
		return fmt.Errorf("%w: empty filter", store.ErrInvalid)
	}
	v, _ := json.Marshal(&sub)
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		return ss.sub.Put([]byte(sub.Filter), v)
	})
}

// DeleteSubscription implements [store.Store].
func (s *Store) DeleteSubscription(_ context.Context, k store.SessionKey, f store.Fence, filter string) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		return ss.sub.Delete([]byte(filter))
	})
}

// Append implements [store.Store].
func (s *Store) Append(_ context.Context, k store.SessionKey, f store.Fence, lim store.QueueLimits, entries []store.Entry, msgs []*store.Message) (store.AppendResult, error) {
	var res store.AppendResult
	if len(entries) != len(msgs) {
		return res, fmt.Errorf("%w: %d entries, %d messages", store.ErrInvalid, len(entries), len(msgs))
	}
	for i, e := range entries {
		if msgs[i] == nil || msgs[i].ID == "" || msgs[i].ID != e.MsgID {
			return res, fmt.Errorf("%w: entry %d: message ID mismatch", store.ErrInvalid, i)
		}
	}
	err := s.update(func(tx *bolt.Tx) error {
		res = store.AppendResult{}
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		for i, e := range entries {
			if ss.qe.Get([]byte(e.MsgID)) != nil {
				res.Duplicates++
				continue
			}
			if lim.MaxLen > 0 && queueLen(ss.q) >= lim.MaxLen {
				if !lim.DropOldest {
					res.Refused++
					continue
				}
				ck, cv := ss.q.Cursor().First()
				if ck != nil {
					id := string(cv)
					if err := ss.q.Delete(ck); err != nil {
						return err
					}
					_ = ss.qe.Delete([]byte(id))
					if err := unref(tx, id); err != nil {
						return err
					}
					res.DroppedOldest++
				}
			}
			seq := u64(ss.b.Get(kSeq)) + 1
			if err := ss.b.Put(kSeq, be(seq)); err != nil {
				return err
			}
			e.Seq = seq
			v, _ := json.Marshal(&e)
			if err := ss.q.Put(be(seq), []byte(e.MsgID)); err != nil {
				return err
			}
			if err := ss.qe.Put([]byte(e.MsgID), v); err != nil {
				return err
			}
			if err := ref(tx, msgs[i]); err != nil {
				return err
			}
			res.Added++
		}
		return nil
	})
	return res, err
}

// Send implements [store.Store].
func (s *Store) Send(_ context.Context, k store.SessionKey, f store.Fence, entries []store.Entry) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		for _, e := range entries {
			queued := false
			if v := ss.qe.Get([]byte(e.MsgID)); v != nil {
				var qe store.Entry
				if err := json.Unmarshal(v, &qe); err != nil {
					return err
				}
				_ = ss.q.Delete(be(qe.Seq))
				_ = ss.qe.Delete([]byte(e.MsgID))
				queued = true
			}
			if e.QoS == 0 {
				if queued {
					if err := unref(tx, e.MsgID); err != nil {
						return err
					}
				}
				continue
			}
			if !queued {
				ok, err := refExisting(tx, e.MsgID)
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("%w: message %s is not stored", store.ErrInvalid, e.MsgID)
				}
			}
			if old := ss.inf.Get(pk(e.PacketID)); old != nil {
				var oe store.Entry
				if json.Unmarshal(old, &oe) == nil {
					_ = unref(tx, oe.MsgID)
				}
			}
			v, _ := json.Marshal(&e)
			if err := ss.inf.Put(pk(e.PacketID), v); err != nil {
				return err
			}
		}
		return nil
	})
}

// Pubrel implements [store.Store].
func (s *Store) Pubrel(_ context.Context, k store.SessionKey, f store.Fence, packetID uint16) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		v := ss.inf.Get(pk(packetID))
		if v == nil {
			return nil
		}
		var e store.Entry
		if err := json.Unmarshal(v, &e); err != nil {
			return err
		}
		e.Pubrel = true
		nv, _ := json.Marshal(&e)
		return ss.inf.Put(pk(packetID), nv)
	})
}

// Complete implements [store.Store].
func (s *Store) Complete(_ context.Context, k store.SessionKey, f store.Fence, packetIDs []uint16) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		for _, p := range packetIDs {
			v := ss.inf.Get(pk(p))
			if v == nil {
				continue
			}
			var e store.Entry
			if err := json.Unmarshal(v, &e); err != nil {
				return err
			}
			_ = ss.inf.Delete(pk(p))
			if err := unref(tx, e.MsgID); err != nil {
				return err
			}
		}
		return nil
	})
}

// Dequeue implements [store.Store].
func (s *Store) Dequeue(_ context.Context, k store.SessionKey, f store.Fence, msgIDs []string) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		for _, id := range msgIDs {
			v := ss.qe.Get([]byte(id))
			if v == nil {
				continue
			}
			var e store.Entry
			if err := json.Unmarshal(v, &e); err != nil {
				return err
			}
			_ = ss.q.Delete(be(e.Seq))
			_ = ss.qe.Delete([]byte(id))
			if err := unref(tx, id); err != nil {
				return err
			}
		}
		return nil
	})
}

// PutIncoming implements [store.Store].
func (s *Store) PutIncoming(_ context.Context, k store.SessionKey, f store.Fence, in store.Incoming) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		return ss.in.Put(pk(in.PacketID), []byte(in.MsgID))
	})
}

// DeleteIncoming implements [store.Store].
func (s *Store) DeleteIncoming(_ context.Context, k store.SessionKey, f store.Fence, packetID uint16) error {
	return s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, &f)
		if err != nil {
			return err
		}
		return ss.in.Delete(pk(packetID))
	})
}

// Load implements [store.Store].
func (s *Store) Load(_ context.Context, k store.SessionKey) (*store.State, error) {
	st := &store.State{Messages: map[string]*store.Message{}}
	err := s.update(func(tx *bolt.Tx) error {
		ss, err := session(tx, k, nil)
		if err != nil {
			return err
		}
		st.Epoch = u64(ss.b.Get(kEpoch))
		if v := ss.b.Get(kRec); v != nil {
			st.Session = &store.Session{}
			if err := json.Unmarshal(v, st.Session); err != nil {
				return err
			}
		}
		if err := ss.sub.ForEach(func(_, v []byte) error {
			var sub store.Subscription
			if err := json.Unmarshal(v, &sub); err != nil {
				return err
			}
			st.Subs = append(st.Subs, sub)
			return nil
		}); err != nil {
			return err
		}
		add := func(id string) {
			if _, ok := st.Messages[id]; !ok {
				if m := loadMsg(tx, id); m != nil {
					st.Messages[id] = m
				}
			}
		}
		if err := ss.q.ForEach(func(_, id []byte) error {
			var e store.Entry
			if err := json.Unmarshal(ss.qe.Get(id), &e); err != nil {
				return err
			}
			st.Queue = append(st.Queue, e)
			add(e.MsgID)
			return nil
		}); err != nil {
			return err
		}
		if err := ss.inf.ForEach(func(_, v []byte) error {
			var e store.Entry
			if err := json.Unmarshal(v, &e); err != nil {
				return err
			}
			st.Inflight = append(st.Inflight, e)
			add(e.MsgID)
			return nil
		}); err != nil {
			return err
		}
		return ss.in.ForEach(func(k, v []byte) error {
			st.Incoming = append(st.Incoming, store.Incoming{PacketID: binary.BigEndian.Uint16(k), MsgID: string(v)})
			return nil
		})
	})
	return st, err
}

// PutRetained implements [store.Store].
func (s *Store) PutRetained(_ context.Context, tenant string, m *store.Message) (bool, error) {
	if tenant == "" || m == nil || m.Topic == "" {
		return false, fmt.Errorf("%w: tenant and topic are required", store.ErrInvalid)
	}
	changed := false
	err := s.update(func(tx *bolt.Tx) error {
		b, err := tx.Bucket(bRetained).CreateBucketIfNotExists([]byte(tenant))
		if err != nil {
			return err
		}
		key := []byte(m.Topic)
		if v := b.Get(key); v != nil {
			var old store.Message
			if json.Unmarshal(v, &old) == nil && old.Created > m.Created {
				return nil
			}
			if len(m.Payload) == 0 {
				changed = true
				return b.Delete(key)
			}
		} else if len(m.Payload) == 0 {
			return nil
		}
		v, _ := json.Marshal(m)
		changed = true
		return b.Put(key, v)
	})
	return changed, err
}

// LookupRetained implements [store.Store]. Topics are kept sorted, so the
// scan starts at the filter's literal prefix rather than the whole tenant.
func (s *Store) LookupRetained(_ context.Context, tenant, filter string, limit int) ([]*store.Message, error) {
	if tenant == "" || filter == "" {
		return nil, fmt.Errorf("%w: tenant and filter are required", store.ErrInvalid)
	}
	if limit <= 0 {
		limit = 1000
	}
	var out []*store.Message
	now := time.Now().Unix()
	err := s.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bRetained).Bucket([]byte(tenant))
		if b == nil {
			return nil
		}
		prefix := literalPrefix(filter)
		c := b.Cursor()
		for k, v := c.Seek([]byte(prefix)); k != nil && strings.HasPrefix(string(k), prefix) && len(out) < limit; k, v = c.Next() {
			if !match(filter, string(k)) {
				continue
			}
			var m store.Message
			if err := json.Unmarshal(v, &m); err != nil {
				return err
			}
			if m.Expiry != 0 && m.Expiry <= now {
				continue
			}
			out = append(out, &m)
		}
		return nil
	})
	sort.SliceStable(out, func(i, j int) bool { return out[i].Topic < out[j].Topic })
	return out, err
}

// literalPrefix is the part of filter before its first wildcard, less the
// separator before it ("a/#" matches "a" as well, [MQTT-4.7.1-2]).
func literalPrefix(filter string) string {
	if i := strings.IndexAny(filter, "+#"); i >= 0 {
		return strings.TrimSuffix(filter[:i], "/")
	}
	return filter
}

// match is MQTT topic matching ([MQTT-4.7]), $-topics excluded from leading
// wildcards.
func match(filter, topic string) bool {
	if strings.HasPrefix(topic, "$") && (strings.HasPrefix(filter, "+") || strings.HasPrefix(filter, "#")) {
		return false
	}
	fs, ts := strings.Split(filter, "/"), strings.Split(topic, "/")
	for i, f := range fs {
		if f == "#" {
			return true
		}
		if i >= len(ts) {
			return false
		}
		if f != "+" && f != ts[i] {
			return false
		}
	}
	return len(fs) == len(ts)
}
