package raftnode

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	bolt "go.etcd.io/bbolt"
)

// BoltStore is a raft.LogStore and raft.StableStore on one bbolt file, fsynced
// on every write.
//
// NOTE(coordinator): this replaces hashicorp/raft-boltdb/v2, which the issue
// suggested. raft-boltdb/v2 v2.3.1 (the newest) imports
// github.com/hashicorp/go-metrics/compat, a package go-metrics dropped in
// v0.7.0, and raft v1.8.0 requires go-metrics v0.7.0, so the two cannot be
// built together. The format here is ours: one bucket of logs keyed by
// big-endian index, one bucket of stable keys.
type BoltStore struct {
	db *bolt.DB

	// mu orders Close after every operation in flight; closed parks those
	// that arrive later. Raft's transport can run a heartbeat on its own
	// goroutine while the node shuts down, and raft panics when it cannot
	// save the term: an error would crash the process and a silent success
	// would acknowledge what was never stored, so a late caller waits for
	// good on a node that is gone.
	mu     sync.RWMutex
	closed bool
	parked chan struct{}
}

var (
	bucketLogs   = []byte("logs")
	bucketStable = []byte("stable")
)

// errKeyNotFound is what raft expects from a StableStore for a missing key:
// hashicorp/raft compares err.Error() with "not found" (api.go, raft.go).
var errKeyNotFound = errors.New("not found")

// OpenBoltStore opens (creating if needed) the store at path.
func OpenBoltStore(path string) (*BoltStore, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second, NoFreelistSync: true})
	if err != nil {
		return nil, fmt.Errorf("open raft store %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketLogs, bucketStable} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("init raft store: %w", err)
	}
	return &BoltStore{db: db, parked: make(chan struct{})}, nil
}

// Close waits for operations in flight and closes the file. Later calls
// park (see BoltStore.mu).
func (s *BoltStore) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	return s.db.Close()
}

func (s *BoltStore) view(fn func(*bolt.Tx) error) error {
	s.enter()
	defer s.mu.RUnlock()
	return s.db.View(fn)
}

func (s *BoltStore) update(fn func(*bolt.Tx) error) error {
	s.enter()
	defer s.mu.RUnlock()
	return s.db.Update(fn)
}

// enter takes the read lock, or parks for good once the store is closed
// (see BoltStore.mu).
func (s *BoltStore) enter() {
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		<-s.parked
	}
}

func u64(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// FirstIndex implements raft.LogStore.
func (s *BoltStore) FirstIndex() (uint64, error) {
	var idx uint64
	err := s.view(func(tx *bolt.Tx) error {
		if k, _ := tx.Bucket(bucketLogs).Cursor().First(); k != nil {
			idx = binary.BigEndian.Uint64(k)
		}
		return nil
	})
	return idx, err
}

// LastIndex implements raft.LogStore.
func (s *BoltStore) LastIndex() (uint64, error) {
	var idx uint64
	err := s.view(func(tx *bolt.Tx) error {
		if k, _ := tx.Bucket(bucketLogs).Cursor().Last(); k != nil {
			idx = binary.BigEndian.Uint64(k)
		}
		return nil
	})
	return idx, err
}

// GetLog implements raft.LogStore.
func (s *BoltStore) GetLog(index uint64, out *raft.Log) error {
	return s.view(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketLogs).Get(u64(index))
		if v == nil {
			return raft.ErrLogNotFound
		}
		return decodeLog(v, out)
	})
}

// StoreLog implements raft.LogStore.
func (s *BoltStore) StoreLog(l *raft.Log) error { return s.StoreLogs([]*raft.Log{l}) }

// StoreLogs implements raft.LogStore: all logs in one fsynced transaction.
func (s *BoltStore) StoreLogs(logs []*raft.Log) error {
	return s.update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketLogs)
		for _, l := range logs {
			if err := b.Put(u64(l.Index), encodeLog(l)); err != nil {
				return err
			}
		}
		return nil
	})
}

// DeleteRange implements raft.LogStore.
func (s *BoltStore) DeleteRange(minIdx, maxIdx uint64) error {
	return s.update(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketLogs).Cursor()
		for k, _ := c.Seek(u64(minIdx)); k != nil; k, _ = c.Next() {
			if binary.BigEndian.Uint64(k) > maxIdx {
				break
			}
			if err := c.Delete(); err != nil {
				return err
			}
		}
		return nil
	})
}

// Set implements raft.StableStore.
func (s *BoltStore) Set(k, v []byte) error {
	return s.update(func(tx *bolt.Tx) error { return tx.Bucket(bucketStable).Put(k, v) })
}

// Get implements raft.StableStore.
func (s *BoltStore) Get(k []byte) ([]byte, error) {
	var out []byte
	err := s.view(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketStable).Get(k)
		if v == nil {
			return errKeyNotFound
		}
		out = append([]byte(nil), v...)
		return nil
	})
	return out, err
}

// SetUint64 implements raft.StableStore.
func (s *BoltStore) SetUint64(k []byte, v uint64) error { return s.Set(k, u64(v)) }

// GetUint64 implements raft.StableStore.
func (s *BoltStore) GetUint64(k []byte) (uint64, error) {
	v, err := s.Get(k)
	if err != nil {
		return 0, err
	}
	if len(v) != 8 {
		return 0, fmt.Errorf("stable key %q: %d bytes, want 8", k, len(v))
	}
	return binary.BigEndian.Uint64(v), nil
}

// Log encoding: version byte, uvarint index, term, type; uvarint-length data
// and extensions; varint appended-at in Unix nanoseconds.
const logFormat = 1

func encodeLog(l *raft.Log) []byte {
	b := make([]byte, 0, 32+len(l.Data)+len(l.Extensions))
	b = append(b, logFormat)
	b = binary.AppendUvarint(b, l.Index)
	b = binary.AppendUvarint(b, l.Term)
	b = append(b, byte(l.Type))
	b = binary.AppendUvarint(b, uint64(len(l.Data)))
	b = append(b, l.Data...)
	b = binary.AppendUvarint(b, uint64(len(l.Extensions)))
	b = append(b, l.Extensions...)
	var at int64
	if !l.AppendedAt.IsZero() {
		at = l.AppendedAt.UnixNano()
	}
	return binary.AppendVarint(b, at)
}

var errBadLog = errors.New("malformed stored log")

func decodeLog(b []byte, l *raft.Log) error {
	if len(b) < 1 || b[0] != logFormat {
		return errBadLog
	}
	b = b[1:]
	next := func() uint64 {
		v, n := binary.Uvarint(b)
		if n <= 0 {
			b = nil
			return 0
		}
		b = b[n:]
		return v
	}
	bytesOf := func() []byte {
		n := next()
		if uint64(len(b)) < n {
			b = nil
			return nil
		}
		out := append([]byte(nil), b[:n]...)
		b = b[n:]
		return out
	}
	l.Index = next()
	l.Term = next()
	if len(b) < 1 {
		return errBadLog
	}
	l.Type = raft.LogType(b[0])
	b = b[1:]
	l.Data = bytesOf()
	l.Extensions = bytesOf()
	at, n := binary.Varint(b)
	if n <= 0 {
		return errBadLog
	}
	l.AppendedAt = time.Time{}
	if at != 0 {
		l.AppendedAt = time.Unix(0, at)
	}
	return nil
}
