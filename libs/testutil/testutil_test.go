package testutil

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// recorder is a testing.TB that records Log and Fatal calls instead of acting
// on them, so the helpers' failure paths can be tested.
type recorder struct {
	testing.TB // panics on any method not overridden

	mu       sync.Mutex
	logs     []string
	fatal    string
	cleanups []func()
}

func (r *recorder) Helper() {}

func (r *recorder) Log(args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.logs = append(r.logs, fmt.Sprint(args...))
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fatal = fmt.Sprintf(format, args...)
}

func (r *recorder) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }

func (r *recorder) runCleanups() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

func (r *recorder) lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.logs...)
}

func TestLogger(t *testing.T) {
	t.Parallel()
	r := &recorder{}
	logger := Logger(r)

	logger.Debug("debug shown", "k", "v")
	require.Len(t, r.lines(), 1)
	require.Contains(t, r.lines()[0], "debug shown")
	require.Contains(t, r.lines()[0], "k=v")
	require.False(t, strings.HasSuffix(r.lines()[0], "\n"))

	r.runCleanups()
	logger.Info("after cleanup")
	require.Len(t, r.lines(), 1, "writes after cleanup must be dropped")
}

func TestLogger_ConcurrentWithCleanup(t *testing.T) {
	t.Parallel()
	r := &recorder{}
	logger := Logger(r)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			for j := range 100 {
				logger.Info("record", "g", i, "j", j)
			}
		})
	}
	r.runCleanups()
	wg.Wait()
	n := len(r.lines())
	logger.Info("late")
	require.Len(t, r.lines(), n)
}

// TestLogger_Real uses a real *testing.T, including logging from a goroutine
// that outlives the test.
func TestLogger_Real(t *testing.T) {
	t.Parallel()
	logger := Logger(t)
	logger.Info("hello from the test logger")
	done := make(chan struct{})
	t.Cleanup(func() { <-done })
	go func() {
		defer close(done)
		for range 5 {
			logger.Info("background record")
		}
	}()
}

func TestEventually(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		succeedAt int32 // call number that returns nil; 0 for never
		timeout   time.Duration
		wantFatal string
	}{
		{name: "immediate", succeedAt: 1, timeout: time.Second},
		{name: "after_retries", succeedAt: 4, timeout: 5 * time.Second},
		{name: "timeout_reports_last_error", succeedAt: 0, timeout: 50 * time.Millisecond, wantFatal: "not yet"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := &recorder{}
			var calls atomic.Int32
			Eventually(r, tc.timeout, func() error {
				n := calls.Add(1)
				if n == tc.succeedAt {
					return nil
				}
				return fmt.Errorf("not yet (call %d)", n)
			})
			if tc.wantFatal == "" {
				require.Empty(t, r.fatal)
				require.Equal(t, tc.succeedAt, calls.Load())
				return
			}
			require.Contains(t, r.fatal, tc.wantFatal)
			require.Contains(t, r.fatal, fmt.Sprintf("call %d", calls.Load()))
			require.Greater(t, calls.Load(), int32(1))
		})
	}
}

func TestEventually_Real(t *testing.T) {
	t.Parallel()
	start := time.Now()
	Eventually(t, time.Second, func() error {
		if time.Since(start) < 30*time.Millisecond {
			return errors.New("too early")
		}
		return nil
	})
}

func TestFreePort(t *testing.T) {
	t.Parallel()
	seen := map[int]bool{}
	for range 20 {
		p := FreePort(t)
		require.Positive(t, p)
		require.False(t, seen[p], "port %d returned twice", p)
		seen[p] = true
	}
}

func TestFreeAddr(t *testing.T) {
	t.Parallel()
	addr := FreeAddr(t)
	require.True(t, strings.HasPrefix(addr, "127.0.0.1:"), addr)
	ln, err := net.Listen("tcp", addr)
	require.NoError(t, err)
	require.NoError(t, ln.Close())
}
