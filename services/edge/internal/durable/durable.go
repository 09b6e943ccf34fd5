// Package durable keeps the edge's MQTT state on local disk for single-node
// mode: persistent sessions with their subscriptions, queued and in-flight
// messages, and retained messages, so they survive a restart.
//
// Writes are group-committed: callers hand operations to one committer
// goroutine, which applies everything waiting in one bbolt transaction and
// one fsync, then wakes the callers that asked to wait. A message is stored
// once, however many sessions hold it, and reference-counted.
package durable

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	bolt "go.etcd.io/bbolt"
)

var (
	// ErrClosed is returned for operations after Close.
	ErrClosed = errors.New("durable store closed")
	// ErrFenced is returned (wrapped) by a shared store for a write, or an
	// activation, under an epoch older than the session's current one:
	// another edge owns the session now.
	ErrFenced = errors.New("session owned under a newer epoch")
	// ErrQueueQuota is returned (wrapped) by a shared store for an
	// [Entry.Offline] enqueue refused by the tenant's queue bound: nothing
	// was stored, and the delivery is dropped for that session.
	ErrQueueQuota = errors.New("tenant's queue quota reached")
)

var (
	bucketSessions = []byte("sessions")
	bucketSubs     = []byte("subs")
	bucketMsgs     = []byte("msgs")
	bucketQueue    = []byte("queue")
	bucketInflight = []byte("inflight")
	bucketRetained = []byte("retained")
	// bucketIncoming holds the QoS 2 messages a session published and the
	// edge acknowledged with PUBREC, until PUBREL: a resent PUBLISH with the
	// same packet ID is not delivered again, even after a restart.
	bucketIncoming = []byte("incoming")
	// bucketTook holds, per session, the msgIDs of its last QoS 2
	// deliveries under (id, n) with n counting up from 1, and under the
	// bare prefix (id, "") the last n used, so that the oldest is found
	// without a scan.
	bucketTook = []byte("took")
	allBuckets = [][]byte{bucketSessions, bucketSubs, bucketMsgs, bucketQueue, bucketInflight, bucketRetained, bucketIncoming, bucketTook}
)

// Message is a stored application message.
type Message struct {
	ID      string          `json:"id"` // msgID: "<edge>/<incarnation>/<seq>"
	Topic   string          `json:"t"`
	Payload []byte          `json:"p,omitempty"`
	QoS     byte            `json:"q,omitempty"`
	Retain  bool            `json:"r,omitempty"`
	Props   json.RawMessage `json:"props,omitempty"` // [Props] as JSON
	Origin  string          `json:"o,omitempty"`
	Created int64           `json:"c"`
	Expiry  int64           `json:"e,omitempty"`
	Refs    int             `json:"refs,omitempty"`
}

// Props is the stored form of the MQTT 5 properties a message carries
// ([Message.Props]).
type Props struct {
	PayloadFormat   *byte                  `json:"pf,omitempty"`
	ContentType     string                 `json:"ct,omitempty"`
	ResponseTopic   string                 `json:"rt,omitempty"`
	CorrelationData []byte                 `json:"cd,omitempty"`
	User            []packets.UserProperty `json:"u,omitempty"`
	Expiry          uint32                 `json:"mei,omitempty"` // message expiry interval as received, seconds
}

// Session is a stored persistent session.
type Session struct {
	ID              string          `json:"id"`
	Listener        string          `json:"listener"`
	Username        []byte          `json:"username,omitempty"`
	ProtocolVersion byte            `json:"v"`
	Clean           bool            `json:"clean,omitempty"`
	ExpiryInterval  uint32          `json:"sei,omitempty"`
	Props           json.RawMessage `json:"props,omitempty"`
	// Will is the will of the session's last connection, kept while it may
	// still be published: an edge that takes custody of the session after
	// its owner died publishes it. A shared store holds one; so does a
	// single-node edge's own store, for a will its stop left, which it
	// publishes when it starts again.
	Will *Will `json:"will,omitempty"`
	// Disconnected is when the session's last connection ended, in unix
	// nanoseconds, where an edge knew it: a session handed over offline
	// carries it, so that its expiry and its will's delay count from
	// then, not from each hand-over. 0 while connected, or not known (the
	// session's edge died). Between edges it travels as the time offline
	// (EncodeTransfer), so that their clocks need not agree; in the
	// shared store it is the writing edge's clock.
	Disconnected int64 `json:"dis,omitempty"`
}

// DisconnectedAt is [Session.Disconnected] as a time, zero if not known.
func (s *Session) DisconnectedAt() time.Time {
	if s.Disconnected == 0 {
		return time.Time{}
	}
	return time.Unix(0, s.Disconnected)
}

// Persistent reports whether the session outlives its connection.
func (s *Session) Persistent() bool {
	if s.ProtocolVersion == 5 {
		return s.ExpiryInterval > 0
	}
	return !s.Clean
}

// Will is a stored will message. Its msgID is fixed when its connection
// connects, so that publishing it again (after a second failure) stores it
// once per recipient.
type Will struct {
	Msg   *Message `json:"m"`
	Delay uint32   `json:"d,omitempty"` // will delay interval, seconds
}

// Subscription is a stored subscription of a session.
type Subscription struct {
	Filter            string `json:"f"`
	QoS               byte   `json:"q"`
	NoLocal           bool   `json:"nl,omitempty"`
	RetainAsPublished bool   `json:"rap,omitempty"`
	RetainHandling    byte   `json:"rh,omitempty"`
	Identifier        int    `json:"id,omitempty"`
}

// Entry is a message queued for, or in flight to, a session.
type Entry struct {
	Seq      uint64 `json:"s,omitempty"`  // queue order
	PacketID uint16 `json:"pk,omitempty"` // in flight only
	MsgID    string `json:"m"`
	QoS      byte   `json:"q"`
	Retain   bool   `json:"r,omitempty"`
	SubIDs   []int  `json:"ids,omitempty"`
	Pubrel   bool   `json:"rel,omitempty"` // QoS 2: PUBREC received, PUBREL owed
	Order    int64  `json:"o,omitempty"`   // send order among the session's in-flight messages
	// TookQoS2 marks, on Enqueue, a QoS 2 delivery the session takes only
	// once: the store remembers its msgID (SessionState.TookQoS2).
	TookQoS2 bool `json:"t,omitempty"`
	// Offline marks, on Enqueue, queueing for a session with no client
	// connected: a shared store may refuse it by the tenant's queue bound
	// ([ErrQueueQuota]). Deliveries written ahead of a send are never
	// refused so.
	Offline bool `json:"-"`
	// StoreFirst marks, on Send, an entry whose queueing may have been
	// refused by the tenant's queue bound: a shared store stores the
	// message first, as for a live delivery, not held to the bound.
	StoreFirst bool     `json:"-"`
	Msg        *Message `json:"-"`
}

// Incoming is a QoS 2 message received from a session's client and not yet
// released by its PUBREL.
type Incoming struct {
	PacketID uint16 `json:"pk"`
	MsgID    string `json:"m"`
	// Unconfirmed marks a message that was not acknowledged: its resend is
	// routed under MsgID again. Fingerprint tells the resend (same topic and
	// payload) from a new message under the packet ID.
	Unconfirmed bool   `json:"u,omitempty"`
	Fingerprint uint64 `json:"f,omitempty"`
}

// SessionState is everything stored for one session.
type SessionState struct {
	Session  Session
	Subs     []Subscription
	Queue    []Entry // in queue order
	Inflight []Entry
	Incoming []Incoming
	// TookQoS2 names the last QoS 2 messages the session took, by msgID,
	// oldest first, so that a resend of one under the same msgID is not
	// delivered twice after the session moved: handed between edges on a
	// takeover, and stored (the last TookQoS2Len enqueued with
	// Entry.TookQoS2) for a session resumed from the store.
	TookQoS2 []string
}

// TookQoS2Len bounds the QoS 2 msgIDs a store remembers per session: a
// resend comes within seconds of the failed forward, after far fewer QoS 2
// messages than this.
const TookQoS2Len = 1024

// Store is the on-disk state of one edge.
type Store struct {
	db        *bolt.DB
	logger    *slog.Logger
	ops       chan *op
	done      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once
}

type op struct {
	apply func(tx *bolt.Tx) error
	done  chan error // nil: nobody waits
}

// Open opens (creating if needed) the store in dir.
func Open(dir string, logger *slog.Logger) (*Store, error) {
	db, err := bolt.Open(filepath.Join(dir, "edge.db"), 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open durable store: %w", err)
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		for _, b := range allBuckets {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("open durable store: %w", err)
	}
	s := &Store{db: db, logger: logger, ops: make(chan *op, 4096), done: make(chan struct{})}
	s.wg.Add(1)
	go s.commitLoop()
	return s, nil
}

// Close flushes pending operations and closes the file.
func (s *Store) Close() error {
	var err error
	s.closeOnce.Do(func() {
		close(s.done)
		s.wg.Wait()
		err = s.db.Close()
	})
	return err
}

const maxOpsPerTx = 4096

func (s *Store) commitLoop() {
	defer s.wg.Done()
	batch := make([]*op, 0, 256)
	for {
		select {
		case o := <-s.ops:
			batch = append(batch[:0], o)
		case <-s.done:
			// Drain what is left, then stop.
			for {
				select {
				case o := <-s.ops:
					s.commit([]*op{o})
				default:
					return
				}
			}
		}
	more:
		for len(batch) < maxOpsPerTx {
			select {
			case o := <-s.ops:
				batch = append(batch, o)
			default:
				break more
			}
		}
		s.commit(batch)
	}
}

// commit applies a batch in one transaction. An operation that fails is
// reported to its caller alone; the others still commit.
func (s *Store) commit(batch []*op) {
	errs := make([]error, len(batch))
	err := s.db.Update(func(tx *bolt.Tx) error {
		for i, o := range batch {
			errs[i] = o.apply(tx)
		}
		return nil
	})
	for i, o := range batch {
		if o.done == nil {
			if e := errors.Join(err, errs[i]); e != nil && s.logger != nil {
				s.logger.Error("durable write failed", "error", e)
			}
			continue
		}
		o.done <- errors.Join(err, errs[i])
	}
}

// Pending is an operation handed to the committer; Wait blocks until it is
// on disk.
type Pending struct {
	done chan error
	err  error
}

// Wait returns once the operation is committed, with its error.
func (p *Pending) Wait(ctx context.Context) error {
	if p.err != nil || p.done == nil {
		return p.err
	}
	select {
	case err := <-p.done:
		p.err, p.done = err, nil
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// submit hands fn to the committer in call order. Operations commit in the
// order they were submitted, so a caller that submits under its own lock
// orders its writes with that lock.
func (s *Store) submit(wait bool, fn func(tx *bolt.Tx) error) *Pending {
	o := &op{apply: fn}
	if wait {
		o.done = make(chan error, 1)
	}
	select {
	case s.ops <- o:
	case <-s.done:
		return &Pending{err: ErrClosed}
	}
	return &Pending{done: o.done}
}

// do submits fn and, with wait, blocks until it is committed.
func (s *Store) do(ctx context.Context, wait bool, fn func(tx *bolt.Tx) error) error {
	return s.submit(wait, fn).Wait(ctx)
}

func key(parts ...string) []byte {
	n := 0
	for _, p := range parts {
		n += len(p) + 1
	}
	k := make([]byte, 0, n)
	for i, p := range parts {
		if i > 0 {
			k = append(k, 0)
		}
		k = append(k, p...)
	}
	return k
}

func seqKey(id string, seq uint64) []byte {
	return binary.BigEndian.AppendUint64(append([]byte(id), 0), seq)
}

func pktKey(id string, pkt uint16) []byte {
	return binary.BigEndian.AppendUint16(append([]byte(id), 0), pkt)
}

func prefix(id string) []byte { return append([]byte(id), 0) }

func putJSON(b *bolt.Bucket, k []byte, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return b.Put(k, data)
}

// ref stores m if new and adds one reference to it.
func ref(tx *bolt.Tx, m *Message) error {
	b := tx.Bucket(bucketMsgs)
	k := []byte(m.ID)
	var stored Message
	if data := b.Get(k); data != nil {
		if err := json.Unmarshal(data, &stored); err != nil {
			return err
		}
	} else {
		stored = *m
		stored.Refs = 0
	}
	stored.Refs++
	return putJSON(b, k, &stored)
}

// unref drops one reference to msgID, deleting the message at zero.
func unref(tx *bolt.Tx, msgID string) error {
	b := tx.Bucket(bucketMsgs)
	k := []byte(msgID)
	data := b.Get(k)
	if data == nil {
		return nil
	}
	var stored Message
	if err := json.Unmarshal(data, &stored); err != nil {
		return err
	}
	stored.Refs--
	if stored.Refs <= 0 {
		return b.Delete(k)
	}
	return putJSON(b, k, &stored)
}
