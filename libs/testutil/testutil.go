// Package testutil holds helpers shared by the tests of every Keel module:
// a logger that writes through the test ([Logger]), polling instead of
// sleeping ([Eventually]) and loopback ports for in-process servers
// ([FreePort], [FreeAddr]).
//
// It is imported only from _test.go files.
package testutil

import (
	"bytes"
	"log/slog"
	"sync"
	"testing"
	"time"
)

// Logger returns a debug-level text logger whose records go to t.Log, so they
// are shown only when the test fails or under go test -v.
//
// The logger may outlive the test: goroutines still running after the test
// has finished may keep logging. Records written once t's cleanup has run
// are dropped, instead of panicking as a late t.Log would.
func Logger(t testing.TB) *slog.Logger {
	t.Helper()
	w := &testWriter{t: t}
	t.Cleanup(w.close)
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// testWriter forwards writes to t.Log until close is called.
type testWriter struct {
	mu     sync.Mutex
	t      testing.TB
	closed bool // guarded by mu
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		w.t.Log(string(bytes.TrimSuffix(p, []byte("\n"))))
	}
	return len(p), nil
}

func (w *testWriter) close() {
	w.mu.Lock()
	w.closed = true
	w.mu.Unlock()
}

// EventuallyInterval is how often [Eventually] calls its function.
const EventuallyInterval = 10 * time.Millisecond

// Eventually calls fn right away and then every [EventuallyInterval] until
// it returns nil. If timeout passes first, it fails the test with fn's last
// error. Like t.Fatal, it must be called from the test's own goroutine.
func Eventually(t testing.TB, timeout time.Duration, fn func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	ticker := time.NewTicker(EventuallyInterval)
	defer ticker.Stop()
	for {
		err := fn()
		if err == nil {
			return
		}
		if !time.Now().Before(deadline) {
			t.Fatalf("condition not met within %v: %v", timeout, err)
			return
		}
		<-ticker.C
	}
}
