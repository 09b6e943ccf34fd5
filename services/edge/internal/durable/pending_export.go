package durable

// NewPending returns a Pending for a write that a store outside this
// package carries out (the edge's client of the persistence service): Wait
// returns the first value the store sends on done. The store sends exactly
// one value, so done should have a buffer of one.
func NewPending(done chan error) *Pending { return &Pending{done: done} }

// DonePending returns a Pending that is already complete with err: nil when
// there was nothing to store, or the error that kept the write from being
// submitted at all.
func DonePending(err error) *Pending { return &Pending{err: err} }
