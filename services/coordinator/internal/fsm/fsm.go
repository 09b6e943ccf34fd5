// Package fsm is the coordinator's replicated state machine: session ownership,
// membership records, cluster config, ACL versions, Redis group records and the
// slot table, kept in an immutable radix tree so that a snapshot is O(1).
//
// Every Raft log entry is a [CommandType] byte followed by a protobuf command
// from package raftpb ([Encode]). Handlers are registered with
// [RegisterCommand]; [New] registers the built-in ones. Apply is deterministic:
// time arrives inside each command as the leader's clock.
//
// The FSM knows nothing of Raft plumbing beyond the raft.FSM interface; see
// package raftnode for that.
package fsm

import (
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/keelmq/keel/libs/logging"
)

// Response is what [FSM.Apply] returns for a command; the proposer reads it
// from raft.ApplyFuture.Response and unwraps it (see raftnode.Node.Apply).
type Response struct {
	// Msg is the command's result message; nil on error or for a skipped entry.
	Msg proto.Message
	// Err is the command's deterministic refusal (e.g. [ErrStaleEpoch]).
	Err error
}

// Observer is told about every applied entry that has events, after the new
// state is visible, and about every snapshot restore, with nil events: then
// everything up to index may have changed and no event before it will come.
// It runs on the apply goroutine and must not block.
type Observer func(index uint64, events []Event)

// FSM implements raft.FSM. Create it with [New].
type FSM struct {
	logger   *slog.Logger
	handlers [128]*handler

	state atomic.Pointer[State]

	// mu serialises Apply and Restore. Raft already calls them from one
	// goroutine; the lock makes direct use in tests safe too.
	mu       sync.Mutex
	observer Observer

	appliedMu sync.Mutex
	appliedCh chan struct{} // closed and replaced on every state change; guarded by appliedMu
}

var _ raft.FSM = (*FSM)(nil)

// New returns an FSM with an empty state and the built-in commands registered.
// A nil logger discards.
func New(logger *slog.Logger) *FSM {
	if logger == nil {
		logger = logging.Discard()
	}
	f := &FSM{logger: logger, appliedCh: make(chan struct{})}
	f.state.Store(emptyState())
	registerBuiltins(f)
	return f
}

// SetObserver sets the function told about every applied entry. Call it before
// the FSM is handed to Raft.
func (f *FSM) SetObserver(o Observer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.observer = o
}

// State returns the current state. It never blocks.
func (f *FSM) State() *State { return f.state.Load() }

// Changed returns a channel closed at the next state change (apply or restore).
func (f *FSM) Changed() <-chan struct{} {
	f.appliedMu.Lock()
	defer f.appliedMu.Unlock()
	return f.appliedCh
}

func (f *FSM) publish(s *State) {
	f.state.Store(s)
	f.appliedMu.Lock()
	close(f.appliedCh)
	f.appliedCh = make(chan struct{})
	f.appliedMu.Unlock()
}

// Apply applies one committed log entry. It returns *[Response] for command
// entries, nil for entries it skips (already applied, or unknown but
// ignorable). It panics on an entry it cannot decode: continuing would let the
// replicas diverge.
func (f *FSM) Apply(l *raft.Log) any {
	f.mu.Lock()
	defer f.mu.Unlock()
	cur := f.state.Load()
	if l.Index <= cur.index {
		// Raft replays entries after a restore from an older snapshot only
		// if the store lost them; never apply one twice.
		return nil
	}
	if l.Type != raft.LogCommand {
		return nil
	}
	t, cmd, err := f.Decode(l.Data)
	if err != nil {
		f.logger.Error("cannot apply log entry", logging.KeyRaftIndex, l.Index, logging.Err(err))
		panic(fmt.Sprintf("fsm: apply index %d: %v", l.Index, err))
	}
	if cmd == nil {
		f.logger.Warn("skipping unknown ignorable command", logging.KeyRaftIndex, l.Index, "type", uint8(t))
		f.publish(&State{root: cur.root, index: l.Index, sessions: cur.sessions})
		return nil
	}

	tx := newTx(cur, l.Index)
	msg, err := f.handlers[t.Base()].apply(tx, cmd)
	var next *State
	if err != nil {
		// A refused command changes nothing but the applied index.
		next = &State{root: cur.root, index: l.Index, sessions: cur.sessions}
		tx.events = nil
	} else {
		next = tx.commit()
	}
	f.publish(next)
	if f.observer != nil && len(tx.events) > 0 {
		f.observer(l.Index, tx.events)
	}
	return &Response{Msg: msg, Err: err}
}
