package raftnode

import "errors"

// ErrNotLeader is returned for a proposal or linearizable read on a node that
// is not the leader. The caller forwards to the leader or retries.
var ErrNotLeader = errors.New("not the raft leader")

// ErrUnknownOutcome is returned when a proposal may or may not have been
// committed (leadership lost, timeout, shutdown). Retry with the same request
// ID: idempotent commands answer the retry with the original result.
var ErrUnknownOutcome = errors.New("raft outcome unknown")

// ErrNotStarted is returned by a [Node] method called before [Node.Start].
var ErrNotStarted = errors.New("raft node not started")
