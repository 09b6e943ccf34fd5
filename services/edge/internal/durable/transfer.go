package durable

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"

	bolt "go.etcd.io/bbolt"
)

// LoadSession reads what is stored for one session, after every write
// submitted before the call has committed. ok is false when nothing is.
func (s *Store) LoadSession(ctx context.Context, id string) (st SessionState, ok bool, err error) {
	// A waited no-op through the commit loop orders the read after them.
	if err := s.do(ctx, true, func(*bolt.Tx) error { return nil }); err != nil {
		return st, false, err
	}
	err = s.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketSessions).Get([]byte(id))
		if v == nil {
			return nil
		}
		ok = true
		if err := json.Unmarshal(v, &st.Session); err != nil {
			return err
		}
		p := prefix(id)
		each := func(bucket []byte, fn func(v []byte) error) error {
			c := tx.Bucket(bucket).Cursor()
			for k, v := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, v = c.Next() {
				if err := fn(v); err != nil {
					return err
				}
			}
			return nil
		}
		msgs := tx.Bucket(bucketMsgs)
		entry := func(into *[]Entry) func(v []byte) error {
			return func(v []byte) error {
				e, ok, err := readEntry(msgs, v)
				if ok {
					*into = append(*into, e)
				}
				return err
			}
		}
		if err := each(bucketSubs, func(v []byte) error {
			var sub Subscription
			if err := json.Unmarshal(v, &sub); err != nil {
				return err
			}
			st.Subs = append(st.Subs, sub)
			return nil
		}); err != nil {
			return err
		}
		if err := each(bucketQueue, entry(&st.Queue)); err != nil { // keys sort by seq
			return err
		}
		if err := each(bucketInflight, entry(&st.Inflight)); err != nil {
			return err
		}
		st.TookQoS2 = tookOf(tx.Bucket(bucketTook), id)
		return each(bucketIncoming, func(v []byte) error {
			var in Incoming
			if err := json.Unmarshal(v, &in); err != nil {
				return err
			}
			st.Incoming = append(st.Incoming, in)
			return nil
		})
	})
	return st, ok, err
}

// ImportSession stores a session taken over from another edge, replacing
// whatever was stored under its ID, in one transaction, and waits for it.
func (s *Store) ImportSession(ctx context.Context, st SessionState) error {
	if err := s.DeleteSession(ctx, st.Session.ID, false); err != nil {
		return err
	}
	id := st.Session.ID
	return s.do(ctx, true, func(tx *bolt.Tx) error {
		if err := putJSON(tx.Bucket(bucketSessions), []byte(id), &st.Session); err != nil {
			return err
		}
		for _, m := range st.TookQoS2 {
			if err := rememberTook(tx.Bucket(bucketTook), id, m); err != nil {
				return err
			}
		}
		for i := range st.Subs {
			if err := putJSON(tx.Bucket(bucketSubs), key(id, st.Subs[i].Filter), &st.Subs[i]); err != nil {
				return err
			}
		}
		for _, set := range []struct {
			bucket  []byte
			entries []Entry
		}{{bucketQueue, st.Queue}, {bucketInflight, st.Inflight}} {
			for i := range set.entries {
				e := &set.entries[i]
				if e.Msg == nil {
					return fmt.Errorf("import session %s: entry %s without its message", id, e.MsgID)
				}
				k := seqKey(id, e.Seq)
				if bytes.Equal(set.bucket, bucketInflight) {
					k = pktKey(id, e.PacketID)
				}
				if err := ref(tx, e.Msg); err != nil {
					return err
				}
				if err := putJSON(tx.Bucket(set.bucket), k, e); err != nil {
					return err
				}
			}
		}
		for i := range st.Incoming {
			if err := putJSON(tx.Bucket(bucketIncoming), pktKey(id, st.Incoming[i].PacketID), &st.Incoming[i]); err != nil {
				return err
			}
		}
		return nil
	})
}

// transferFormat versions the encoding of a session handed between edges.
const transferFormat = 1

type transfer struct {
	Format   int             `json:"format"`
	Session  Session         `json:"session"`
	Subs     []Subscription  `json:"subs,omitempty"`
	Queue    []transferEntry `json:"queue,omitempty"`
	Inflight []transferEntry `json:"inflight,omitempty"`
	Incoming []Incoming      `json:"incoming,omitempty"`
	TookQoS2 []string        `json:"took_qos2,omitempty"`
	// OfflineFor is how long the session had been offline when it was
	// encoded, in nanoseconds (Session.Disconnected travels as this): the
	// receiving edge dates the end on its own clock, so that a clock
	// running ahead of the sender's cannot expire the session early.
	OfflineFor int64 `json:"offline_ns,omitempty"`
}

// transferEntry carries its message along, which the stored form keeps
// apart (stored once per msgID).
type transferEntry struct {
	Entry
	Message *Message `json:"msg"`
}

// EncodeTransfer encodes a session's state for another edge.
func EncodeTransfer(st SessionState) ([]byte, error) {
	t := transfer{Format: transferFormat, Session: st.Session, Subs: st.Subs, Incoming: st.Incoming, TookQoS2: st.TookQoS2}
	if at := st.Session.DisconnectedAt(); !at.IsZero() {
		t.OfflineFor = max(int64(time.Since(at)), 1)
		t.Session.Disconnected = 0
	}
	for _, e := range st.Queue {
		t.Queue = append(t.Queue, transferEntry{Entry: e, Message: e.Msg})
	}
	for _, e := range st.Inflight {
		t.Inflight = append(t.Inflight, transferEntry{Entry: e, Message: e.Msg})
	}
	return json.Marshal(&t)
}

// DecodeTransfer decodes what EncodeTransfer made, on an edge of the same
// or a later version.
func DecodeTransfer(b []byte) (SessionState, error) {
	var t transfer
	if err := json.Unmarshal(b, &t); err != nil {
		return SessionState{}, fmt.Errorf("decode session transfer: %w", err)
	}
	if t.Format != transferFormat {
		return SessionState{}, fmt.Errorf("decode session transfer: unknown format %d", t.Format)
	}
	if t.Session.ID == "" {
		return SessionState{}, errors.New("decode session transfer: no session id")
	}
	st := SessionState{Session: t.Session, Subs: t.Subs, Incoming: t.Incoming, TookQoS2: t.TookQoS2}
	if t.OfflineFor > 0 {
		// No session outlives the largest expiry interval offline.
		off := min(time.Duration(t.OfflineFor), math.MaxUint32*time.Second)
		st.Session.Disconnected = time.Now().Add(-off).UnixNano()
	}
	for _, set := range []struct {
		from []transferEntry
		to   *[]Entry
	}{{t.Queue, &st.Queue}, {t.Inflight, &st.Inflight}} {
		for _, e := range set.from {
			if e.Message == nil || e.Message.ID != e.MsgID {
				return SessionState{}, fmt.Errorf("decode session transfer: entry %q without its message", e.MsgID)
			}
			e.Entry.Msg = e.Message
			*set.to = append(*set.to, e.Entry)
		}
	}
	return st, nil
}
