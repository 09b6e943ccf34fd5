package durable

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"

	bolt "go.etcd.io/bbolt"
)

// Activate does nothing: one edge's disk holds only its own sessions, so
// there is no other writer to fence.
func (s *Store) Activate(context.Context, string, uint64) error { return nil }

// Deactivate does nothing (see [Store.Activate]).
func (s *Store) Deactivate(string, uint64) {}

// Shared is false: no other edge reads this store.
func (s *Store) Shared() bool { return false }

// PutSession stores or replaces a session record and waits for it.
func (s *Store) PutSession(ctx context.Context, rec Session) error {
	return s.do(ctx, true, func(tx *bolt.Tx) error {
		return putJSON(tx.Bucket(bucketSessions), []byte(rec.ID), &rec)
	})
}

// DeleteSession removes a session and everything it holds.
func (s *Store) DeleteSession(ctx context.Context, id string, wait bool) error {
	return s.do(ctx, wait, func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketSessions).Delete([]byte(id)); err != nil {
			return err
		}
		p := prefix(id)
		for _, name := range [][]byte{bucketSubs, bucketQueue, bucketInflight, bucketIncoming, bucketTook} {
			b := tx.Bucket(name)
			c := b.Cursor()
			var keys [][]byte
			for k, v := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, v = c.Next() {
				keys = append(keys, append([]byte(nil), k...))
				if bytes.Equal(name, bucketQueue) || bytes.Equal(name, bucketInflight) {
					var e Entry
					if err := json.Unmarshal(v, &e); err == nil {
						if err := unref(tx, e.MsgID); err != nil {
							return err
						}
					}
				}
			}
			for _, k := range keys {
				if err := b.Delete(k); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// PutSubscription stores a subscription and waits (it is behind a SUBACK).
func (s *Store) PutSubscription(ctx context.Context, id string, sub Subscription) error {
	return s.do(ctx, true, func(tx *bolt.Tx) error {
		return putJSON(tx.Bucket(bucketSubs), key(id, sub.Filter), &sub)
	})
}

// DeleteSubscription removes a subscription.
func (s *Store) DeleteSubscription(ctx context.Context, id, filter string) error {
	return s.do(ctx, true, func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSubs).Delete(key(id, filter))
	})
}

// Enqueue appends a message to a session's queue; the set-if-absent key
// (session, seq) makes a retry harmless. Wait on the result before
// acknowledging the message to its publisher.
func (s *Store) Enqueue(id string, e Entry) *Pending {
	return s.submit(true, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketQueue)
		k := seqKey(id, e.Seq)
		if b.Get(k) != nil {
			return nil
		}
		if err := ref(tx, e.Msg); err != nil {
			return err
		}
		if e.TookQoS2 {
			if err := rememberTook(tx.Bucket(bucketTook), id, e.MsgID); err != nil {
				return err
			}
		}
		return putJSON(b, k, &e)
	})
}

// rememberTook records msgID as the session's newest QoS 2 delivery and
// forgets the one TookQoS2Len before it.
func rememberTook(b *bolt.Bucket, id, msgID string) error {
	last := prefix(id)
	var n uint64
	if v := b.Get(last); len(v) == 8 {
		n = binary.BigEndian.Uint64(v)
	}
	n++
	if err := b.Put(seqKey(id, n), []byte(msgID)); err != nil {
		return err
	}
	if err := b.Put(last, binary.BigEndian.AppendUint64(nil, n)); err != nil {
		return err
	}
	if n > TookQoS2Len {
		return b.Delete(seqKey(id, n-TookQoS2Len))
	}
	return nil
}

// tookOf lists what rememberTook recorded for the session, oldest first.
func tookOf(b *bolt.Bucket, id string) []string {
	p := prefix(id)
	var out []string
	c := b.Cursor()
	for k, v := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, v = c.Next() {
		if len(k) == len(p)+8 { // not the counter under the bare prefix
			out = append(out, string(v))
		}
	}
	return out
}

// Dequeue removes queue entries (by Seq) without sending them (dropped or
// expired).
func (s *Store) Dequeue(ctx context.Context, id string, gone []Entry) error {
	return s.do(ctx, false, func(tx *bolt.Tx) error {
		for _, e := range gone {
			if err := removeEntry(tx, bucketQueue, seqKey(id, e.Seq)); err != nil {
				return err
			}
		}
		return nil
	})
}

// Send moves queue entries to the in-flight set under their packet IDs; wait
// on the result before the first send, so the packet ID is durable. Entries
// with QoS 0 just leave the queue.
func (s *Store) Send(id string, entries []Entry) *Pending {
	return s.submit(true, func(tx *bolt.Tx) error {
		q, inf := tx.Bucket(bucketQueue), tx.Bucket(bucketInflight)
		for i := range entries {
			e := &entries[i]
			qk := seqKey(id, e.Seq)
			if e.QoS == 0 {
				if err := removeEntry(tx, bucketQueue, qk); err != nil {
					return err
				}
				continue
			}
			if q.Get(qk) != nil {
				if err := q.Delete(qk); err != nil {
					return err
				}
			} else if err := ref(tx, e.Msg); err != nil { // never queued durably (live delivery)
				return err
			}
			if err := putJSON(inf, pktKey(id, e.PacketID), e); err != nil {
				return err
			}
		}
		return nil
	})
}

// PutIncoming records an inbound QoS 2 message before it is routed.
func (s *Store) PutIncoming(ctx context.Context, id string, in Incoming) error {
	return s.do(ctx, true, func(tx *bolt.Tx) error {
		return putJSON(tx.Bucket(bucketIncoming), pktKey(id, in.PacketID), &in)
	})
}

// DeleteIncoming forgets an inbound QoS 2 message once PUBREL arrived, and
// waits: the PUBCOMP leaves after it, and the client may then reuse the
// packet ID for a new message, which a record left behind by a crash would
// make look like a resend of the completed one.
func (s *Store) DeleteIncoming(ctx context.Context, id string, packetID uint16) error {
	return s.do(ctx, true, func(tx *bolt.Tx) error {
		return tx.Bucket(bucketIncoming).Delete(pktKey(id, packetID))
	})
}

// Pubrel records that a QoS 2 delivery got its PUBREC, before PUBREL leaves.
func (s *Store) Pubrel(ctx context.Context, id string, packetID uint16) error {
	return s.do(ctx, true, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketInflight)
		k := pktKey(id, packetID)
		data := b.Get(k)
		if data == nil {
			return nil
		}
		var e Entry
		if err := json.Unmarshal(data, &e); err != nil {
			return err
		}
		e.Pubrel = true
		return putJSON(b, k, &e)
	})
}

// Complete removes an in-flight delivery that the client acknowledged.
func (s *Store) Complete(ctx context.Context, id string, packetID uint16) error {
	return s.do(ctx, false, func(tx *bolt.Tx) error {
		return removeEntry(tx, bucketInflight, pktKey(id, packetID))
	})
}

func removeEntry(tx *bolt.Tx, bucket, k []byte) error {
	b := tx.Bucket(bucket)
	data := b.Get(k)
	if data == nil {
		return nil
	}
	var e Entry
	if err := json.Unmarshal(data, &e); err != nil {
		return err
	}
	if err := b.Delete(k); err != nil {
		return err
	}
	return unref(tx, e.MsgID)
}

// PutRetained stores (or with an empty payload deletes) the retained message
// of a topic, but only if it is not older than the stored one.
func (s *Store) PutRetained(ctx context.Context, m *Message, wait bool) error {
	return s.do(ctx, wait, func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketRetained)
		k := []byte(m.Topic)
		if data := b.Get(k); data != nil {
			var old Message
			if err := json.Unmarshal(data, &old); err == nil && old.Created > m.Created {
				return nil
			}
		}
		if len(m.Payload) == 0 {
			return b.Delete(k)
		}
		return putJSON(b, k, m)
	})
}

// Load reads every session and retained message.
func (s *Store) Load() ([]SessionState, []Message, error) {
	var sessions []SessionState
	var retained []Message
	err := s.db.View(func(tx *bolt.Tx) error {
		msgs := tx.Bucket(bucketMsgs)
		index := map[string]int{}
		if err := tx.Bucket(bucketSessions).ForEach(func(k, v []byte) error {
			var rec Session
			if err := json.Unmarshal(v, &rec); err != nil {
				return err
			}
			index[rec.ID] = len(sessions)
			sessions = append(sessions, SessionState{Session: rec})
			return nil
		}); err != nil {
			return err
		}
		owner := func(k []byte) *SessionState {
			i := bytes.IndexByte(k, 0)
			if i < 0 {
				return nil
			}
			if n, ok := index[string(k[:i])]; ok {
				return &sessions[n]
			}
			return nil
		}
		if err := tx.Bucket(bucketSubs).ForEach(func(k, v []byte) error {
			st := owner(k)
			if st == nil {
				return nil
			}
			var sub Subscription
			if err := json.Unmarshal(v, &sub); err != nil {
				return err
			}
			st.Subs = append(st.Subs, sub)
			return nil
		}); err != nil {
			return err
		}
		for _, bucket := range [][]byte{bucketQueue, bucketInflight} {
			if err := tx.Bucket(bucket).ForEach(func(k, v []byte) error {
				st := owner(k)
				if st == nil {
					return nil
				}
				e, ok, err := readEntry(msgs, v)
				if err != nil || !ok {
					return err
				}
				if bytes.Equal(bucket, bucketQueue) {
					st.Queue = append(st.Queue, e) // keys sort by seq
				} else {
					st.Inflight = append(st.Inflight, e)
				}
				return nil
			}); err != nil {
				return err
			}
		}
		if err := tx.Bucket(bucketIncoming).ForEach(func(k, v []byte) error {
			st := owner(k)
			if st == nil {
				return nil
			}
			var in Incoming
			if err := json.Unmarshal(v, &in); err != nil {
				return err
			}
			st.Incoming = append(st.Incoming, in)
			return nil
		}); err != nil {
			return err
		}
		took := tx.Bucket(bucketTook)
		for i := range sessions {
			sessions[i].TookQoS2 = tookOf(took, sessions[i].Session.ID)
		}
		return tx.Bucket(bucketRetained).ForEach(func(_, v []byte) error {
			var m Message
			if err := json.Unmarshal(v, &m); err != nil {
				return err
			}
			retained = append(retained, m)
			return nil
		})
	})
	return sessions, retained, err
}

// readEntry decodes a queue or in-flight entry with its message. ok is
// false when the message is gone (expired and collected) or unreadable: the
// entry is skipped, as a restart would.
func readEntry(msgs *bolt.Bucket, v []byte) (e Entry, ok bool, err error) {
	if err := json.Unmarshal(v, &e); err != nil {
		return e, false, err
	}
	data := msgs.Get([]byte(e.MsgID))
	if data == nil {
		return e, false, nil
	}
	e.Msg = new(Message)
	if json.Unmarshal(data, e.Msg) != nil {
		return e, false, nil
	}
	return e, true, nil
}
