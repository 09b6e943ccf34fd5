package fsm

import (
	"fmt"

	"google.golang.org/protobuf/proto"
)

// CommandType is the first byte of every Raft log entry: it names the protobuf
// message that follows. Numbers are append-only: never renumber or reuse one,
// even after its command is retired (nomad MessageType).
//
// A command's apply rule never changes meaning once released: a new rule
// gets a new type, and the old type keeps its old rule. Entries written
// under the old rule then replay as every node first applied them (from a
// log or a snapshot restore), and a node too old for the new type stops at
// it (no IgnoreUnknownFlag) instead of applying it by the old rule and
// disagreeing with the others.
type CommandType uint8

// IgnoreUnknownFlag, set on a [CommandType], lets a node that does not know the
// type skip the entry instead of panicking. Set it on a new command only if
// skipping it cannot make replicas diverge in a way that matters, e.g. an
// advisory record, so that old nodes survive a rolling upgrade.
const IgnoreUnknownFlag CommandType = 0x80

// Command types. Append only.
const (
	CmdClaimSessions    CommandType = 1
	CmdReleaseSession   CommandType = 2
	CmdReassignSessions CommandType = 3
	CmdUpsertMember     CommandType = 4
	CmdSetConfig        CommandType = 5
	CmdBumpAclVersion   CommandType = 6
	// CmdAcquirePromotionLease is the first rule of the promotion lease: a
	// holder taking it again keeps its lease epoch, and renew_epoch is not
	// read. Replayed only; CmdAcquirePromotionLeaseV2 is proposed.
	CmdAcquirePromotionLease CommandType = 7
	CmdCompareAndSetRedis    CommandType = 8
	CmdSetSlotTable          CommandType = 9
	// CmdAcquirePromotionLeaseV2 is the same command under the rule that
	// fences writers: a failover's lease is a new epoch even for a holder,
	// and a renewal names the epoch it renews (renew_epoch).
	CmdAcquirePromotionLeaseV2 CommandType = 10
	// CmdReleaseSessions is CmdReleaseSession for many sessions in one
	// entry (the leader's release batcher).
	CmdReleaseSessions CommandType = 11

	// NewestCommand is the newest type this FSM applies, advertised to the
	// other coordinators (discovery.Meta.Commands).
	NewestCommand = CmdReleaseSessions
)

// Base returns t without [IgnoreUnknownFlag].
func (t CommandType) Base() CommandType { return t &^ IgnoreUnknownFlag }

// Ignorable reports whether t carries [IgnoreUnknownFlag].
func (t CommandType) Ignorable() bool { return t&IgnoreUnknownFlag != 0 }

var marshalOpts = proto.MarshalOptions{Deterministic: true}

// Encode returns the log entry for cmd: the type byte followed by the
// deterministic protobuf encoding of cmd.
func Encode(t CommandType, cmd proto.Message) ([]byte, error) {
	buf := make([]byte, 1, 1+proto.Size(cmd))
	buf[0] = byte(t)
	buf, err := marshalOpts.MarshalAppend(buf, cmd)
	if err != nil {
		return nil, fmt.Errorf("encode command %d: %w", t, err)
	}
	return buf, nil
}

// handler is one registered command: how to allocate its message and apply it.
type handler struct {
	name  string
	newFn func() proto.Message
	apply func(tx *Tx, cmd proto.Message) (proto.Message, error)
}

// RegisterCommand registers the handler of command type t on f. Req must be a
// generated protobuf message pointer type. The handler gets a transaction on
// the state and the decoded command; it must be deterministic (no clock, no
// randomness, no I/O). If it returns an error, its writes are discarded and the
// error is handed to the proposer in [Response].Err.
//
// It panics if t is already registered or carries [IgnoreUnknownFlag]: both are
// programming errors found at start-up.
func RegisterCommand[Req, Resp proto.Message](f *FSM, t CommandType, h func(tx *Tx, cmd Req) (Resp, error)) {
	if t.Ignorable() || t == 0 {
		panic(fmt.Sprintf("fsm: register command %d: invalid type", t))
	}
	if f.handlers[t] != nil {
		panic(fmt.Sprintf("fsm: register command %d: already registered", t))
	}
	var zero Req
	mt := zero.ProtoReflect().Type()
	f.handlers[t] = &handler{
		name:  string(mt.Descriptor().Name()),
		newFn: func() proto.Message { return mt.New().Interface() },
		apply: func(tx *Tx, cmd proto.Message) (proto.Message, error) {
			resp, err := h(tx, cmd.(Req))
			if err != nil {
				return nil, err
			}
			return resp, nil
		},
	}
}

// Decode splits a log entry into its type and decoded command. It returns
// (type, nil, nil) for an unknown type carrying [IgnoreUnknownFlag], and an
// error wrapping [ErrUnknownCommand] or [ErrMalformedEntry] otherwise.
func (f *FSM) Decode(data []byte) (CommandType, proto.Message, error) {
	if len(data) == 0 {
		return 0, nil, fmt.Errorf("%w: empty", ErrMalformedEntry)
	}
	t := CommandType(data[0])
	h := f.handlers[t.Base()]
	if h == nil {
		if t.Ignorable() {
			return t, nil, nil
		}
		return t, nil, fmt.Errorf("%w: %d", ErrUnknownCommand, t)
	}
	msg := h.newFn()
	if err := proto.Unmarshal(data[1:], msg); err != nil {
		return t, nil, fmt.Errorf("%w: type %d: %w", ErrMalformedEntry, t, err)
	}
	return t, msg, nil
}
