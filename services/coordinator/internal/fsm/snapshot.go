package fsm

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/services/coordinator/internal/raftpb"
)

// snapshotMagic starts every snapshot; the header's format version follows.
const snapshotMagic = "KEELFSM\x00"

// SnapshotFormat is the version of the record stream written by Persist.
const SnapshotFormat = 1

// maxRecordLen bounds one snapshot record, so a corrupt length cannot make
// Restore allocate without limit.
const maxRecordLen = 64 << 20

// persistedKinds are the tree prefixes written to snapshots, each record as
// (kind byte, uvarint length, protobuf). Index prefixes are rebuilt on restore.
var persistedKinds = map[byte]func() proto.Message{
	prefixSession: func() proto.Message { return new(raftpb.SessionRecord) },
	prefixMember:  func() proto.Message { return new(raftpb.MemberRecord) },
	prefixConfig:  func() proto.Message { return new(raftpb.ConfigEntry) },
	prefixACL:     func() proto.Message { return new(raftpb.AclVersion) },
	prefixRedis:   func() proto.Message { return new(raftpb.RedisGroupRecord) },
	prefixSlots:   func() proto.Message { return new(raftpb.SlotTable) },
	prefixMeta:    func() proto.Message { return new(raftpb.StateMeta) },
	prefixRequest: func() proto.Message { return new(raftpb.RequestRecord) },
}

// Snapshot returns a point-in-time copy of the state in O(1): the immutable
// tree root. Persist streams it while Apply goes on.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	return &snapshot{state: f.state.Load()}, nil
}

type snapshot struct{ state *State }

// Persist writes the header and every record; on any error it cancels the sink.
func (s *snapshot) Persist(sink raft.SnapshotSink) error {
	if err := WriteSnapshot(sink, s.state); err != nil {
		_ = sink.Cancel()
		return err
	}
	if err := sink.Close(); err != nil {
		return fmt.Errorf("close snapshot sink: %w", err)
	}
	return nil
}

func (s *snapshot) Release() {}

// WriteSnapshot writes st to w in the snapshot format.
func WriteSnapshot(w io.Writer, st *State) error {
	var records uint64
	walkPrefix(st.root, nil, func(k []byte, _ any) bool {
		if persistedKinds[k[0]] != nil {
			records++
		}
		return true
	})
	bw := bufio.NewWriterSize(w, 64<<10)
	if _, err := bw.WriteString(snapshotMagic); err != nil {
		return fmt.Errorf("write snapshot: %w", err)
	}
	hdr, err := marshalOpts.Marshal(&raftpb.SnapshotHeader{FormatVersion: SnapshotFormat, Index: st.index, Records: records})
	if err != nil {
		return fmt.Errorf("write snapshot header: %w", err)
	}
	buf := binary.AppendUvarint(nil, uint64(len(hdr)))
	buf = append(buf, hdr...)
	if _, err := bw.Write(buf); err != nil {
		return fmt.Errorf("write snapshot: %w", err)
	}
	var werr error
	walkPrefix(st.root, nil, func(k []byte, v any) bool {
		if persistedKinds[k[0]] == nil {
			return true
		}
		buf = buf[:0]
		buf = append(buf, k[0])
		m := v.(proto.Message)
		buf = binary.AppendUvarint(buf, uint64(marshalOpts.Size(m)))
		buf, werr = marshalOpts.MarshalAppend(buf, m)
		if werr == nil {
			_, werr = bw.Write(buf)
		}
		return werr == nil
	})
	if werr != nil {
		return fmt.Errorf("write snapshot record: %w", werr)
	}
	if err := bw.Flush(); err != nil {
		return fmt.Errorf("write snapshot: %w", err)
	}
	return nil
}

// ReadSnapshot reads a snapshot written by [WriteSnapshot] into a new state.
func ReadSnapshot(r io.Reader) (*State, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	magic := make([]byte, len(snapshotMagic))
	if _, err := io.ReadFull(br, magic); err != nil || string(magic) != snapshotMagic {
		return nil, fmt.Errorf("%w: bad magic", ErrCorruptSnapshot)
	}
	var hdr raftpb.SnapshotHeader
	if err := readMsg(br, &hdr); err != nil {
		return nil, fmt.Errorf("%w: header: %w", ErrCorruptSnapshot, err)
	}
	if hdr.GetFormatVersion() != SnapshotFormat {
		return nil, fmt.Errorf("%w: format %d, want %d", ErrCorruptSnapshot, hdr.GetFormatVersion(), SnapshotFormat)
	}
	tx := newTx(emptyState(), hdr.GetIndex())
	for i := uint64(0); i < hdr.GetRecords(); i++ {
		kind, err := br.ReadByte()
		if err != nil {
			return nil, fmt.Errorf("%w: record %d: %w", ErrCorruptSnapshot, i, err)
		}
		newFn := persistedKinds[kind]
		if newFn == nil {
			return nil, fmt.Errorf("%w: record %d: unknown kind %q", ErrCorruptSnapshot, i, kind)
		}
		m := newFn()
		if err := readMsg(br, m); err != nil {
			return nil, fmt.Errorf("%w: record %d: %w", ErrCorruptSnapshot, i, err)
		}
		restoreRecord(tx, kind, m)
	}
	if _, err := br.ReadByte(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: trailing data", ErrCorruptSnapshot)
	}
	return tx.commit(), nil
}

func readMsg(br *bufio.Reader, m proto.Message) error {
	n, err := binary.ReadUvarint(br)
	if err != nil {
		return err
	}
	if n > maxRecordLen {
		return fmt.Errorf("record of %d bytes", n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(br, b); err != nil {
		return err
	}
	return proto.Unmarshal(b, m)
}

func restoreRecord(tx *Tx, kind byte, m proto.Message) {
	switch r := m.(type) {
	case *raftpb.SessionRecord:
		tx.putSession(nil, r)
	case *raftpb.MemberRecord:
		tx.txn.Insert(memberKey(r.GetMemberId()), r)
	case *raftpb.ConfigEntry:
		tx.txn.Insert(configKey(r.GetKey()), r)
	case *raftpb.AclVersion:
		tx.txn.Insert(aclKey(r.GetTenant()), r)
	case *raftpb.RedisGroupRecord:
		tx.txn.Insert(redisKey(r.GetGroupId()), r)
	case *raftpb.SlotTable:
		tx.txn.Insert(slotsKey, r)
	case *raftpb.StateMeta:
		tx.txn.Insert(metaKey, r)
	case *raftpb.RequestRecord:
		tx.txn.Insert(requestKey(r.GetScope(), r.GetRequestId()), r)
		tx.txn.Insert(expiryKey(r.GetExpiresAtUnixNano(), r.GetScope(), r.GetRequestId()), present{})
	default:
		panic(fmt.Sprintf("fsm: restore: unhandled record kind %q", kind))
	}
}

// Restore replaces the state with the snapshot read from rc and closes rc.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer func() { _ = rc.Close() }()
	st, err := ReadSnapshot(rc)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.publish(st)
	if f.observer != nil {
		f.observer(st.index, nil)
	}
	f.logger.Info("restored snapshot", "raft_index", st.index, "sessions", st.sessions)
	return nil
}
