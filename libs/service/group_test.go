package service

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
)

// events records component calls in order.
type events struct {
	mu  sync.Mutex
	log []string
}

func (e *events) add(s string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.log = append(e.log, s)
}

func (e *events) get() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.log...)
}

// addComponent adds a start/stop component that records its calls and
// returns the given errors.
func addComponent(g *Group, ev *events, name string, startErr, stopErr error) {
	g.Add(name,
		func(context.Context) error { ev.add("start " + name); return startErr },
		func(context.Context) error { ev.add("stop " + name); return stopErr },
	)
}

// runUntilStarted runs g with a last component that cancels Run's context,
// so Run shuts down as soon as everything has started.
func runUntilStarted(t *testing.T, g *Group, stopTimeout time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	g.Add("cancel", func(context.Context) error { cancel(); return nil }, nil)
	return g.Run(ctx, stopTimeout, testutil.Logger(t))
}

func TestGroup_Run(t *testing.T) {
	t.Parallel()
	errStart := errors.New("bind failed")
	errStop := errors.New("flush failed")
	for _, tc := range []struct {
		name    string
		build   func(g *Group, ev *events)
		want    []string
		wantErr string // exact error text; "" for none
		wantIs  error
	}{
		{
			name: "start_in_order_stop_in_reverse",
			build: func(g *Group, ev *events) {
				addComponent(g, ev, "a", nil, nil)
				addComponent(g, ev, "b", nil, nil)
				addComponent(g, ev, "c", nil, nil)
			},
			want: []string{"start a", "start b", "start c", "stop c", "stop b", "stop a"},
		},
		{
			name: "start_error_stops_started_in_reverse",
			build: func(g *Group, ev *events) {
				addComponent(g, ev, "a", nil, nil)
				addComponent(g, ev, "b", nil, nil)
				addComponent(g, ev, "c", errStart, nil)
				addComponent(g, ev, "d", nil, nil)
			},
			want:    []string{"start a", "start b", "start c", "stop b", "stop a"},
			wantErr: "start c: bind failed",
			wantIs:  errStart,
		},
		{
			name: "first_stop_error_returned_and_others_still_stopped",
			build: func(g *Group, ev *events) {
				addComponent(g, ev, "a", nil, nil)
				addComponent(g, ev, "b", nil, errors.New("second"))
				addComponent(g, ev, "c", nil, errStop)
			},
			want:    []string{"start a", "start b", "start c", "stop c", "stop b", "stop a"},
			wantErr: "stop c: flush failed",
			wantIs:  errStop,
		},
		{
			name: "start_error_wins_over_stop_error",
			build: func(g *Group, ev *events) {
				addComponent(g, ev, "a", nil, errStop)
				addComponent(g, ev, "b", errStart, nil)
			},
			want:    []string{"start a", "start b", "stop a"},
			wantErr: "start b: bind failed",
		},
		{
			name: "nil_start_and_stop",
			build: func(g *Group, ev *events) {
				g.Add("stop-only", nil, func(context.Context) error { ev.add("stop stop-only"); return nil })
				g.Add("start-only", func(context.Context) error { ev.add("start start-only"); return nil }, nil)
				g.Add("none", nil, nil)
			},
			want: []string{"start start-only", "stop stop-only"},
		},
		{
			name: "run_components_interleaved",
			build: func(g *Group, ev *events) {
				addComponent(g, ev, "a", nil, nil)
				g.AddRun("loop", func(ctx context.Context) error {
					ev.add("run loop")
					<-ctx.Done()
					ev.add("loop returned")
					return ctx.Err()
				})
				// Wait until the loop is running so the order is deterministic.
				g.Add("b", func(context.Context) error {
					for !slices.Contains(ev.get(), "run loop") {
						time.Sleep(time.Millisecond)
					}
					ev.add("start b")
					return nil
				}, func(context.Context) error { ev.add("stop b"); return nil })
			},
			want: []string{"start a", "run loop", "start b", "stop b", "loop returned", "stop a"},
		},
		{
			name:  "empty",
			build: func(*Group, *events) {},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var (
				g  Group
				ev events
			)
			tc.build(&g, &ev)
			err := runUntilStarted(t, &g, time.Second)
			require.Equal(t, tc.want, ev.get())
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.EqualError(t, err, tc.wantErr)
			if tc.wantIs != nil {
				require.ErrorIs(t, err, tc.wantIs)
			}
		})
	}
}

func TestGroup_Run_WaitsForContext(t *testing.T) {
	t.Parallel()
	var (
		g  Group
		ev events
	)
	addComponent(&g, &ev, "a", nil, nil)
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- g.Run(ctx, time.Second, testutil.Logger(t)) }()

	testutil.Eventually(t, 5*time.Second, func() error {
		if !slices.Contains(ev.get(), "start a") {
			return errors.New("not started")
		}
		return nil
	})
	time.Sleep(20 * time.Millisecond)
	require.Equal(t, []string{"start a"}, ev.get(), "must not stop before ctx is done")
	cancel()
	require.NoError(t, <-errc)
	require.Equal(t, []string{"start a", "stop a"}, ev.get())
}

func TestGroup_Run_CanceledBeforeStart(t *testing.T) {
	t.Parallel()
	var (
		g  Group
		ev events
	)
	addComponent(&g, &ev, "a", nil, nil)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.NoError(t, g.Run(ctx, time.Second, nil))
	require.Empty(t, ev.get())
}

func TestGroup_Run_Twice(t *testing.T) {
	t.Parallel()
	var g Group
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	require.NoError(t, g.Run(ctx, time.Second, nil))
	require.ErrorIs(t, g.Run(ctx, time.Second, nil), ErrAlreadyRun)
}

func TestGroup_Run_StopTimeout(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		stop func(ctx context.Context, stuck <-chan struct{}) error
	}{
		{"honours_deadline", func(ctx context.Context, _ <-chan struct{}) error { <-ctx.Done(); return ctx.Err() }},
		// Blocks until the test ends: Run returning at all proves it abandoned the stop.
		{"ignores_deadline", func(_ context.Context, stuck <-chan struct{}) error { <-stuck; return nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var (
				g  Group
				ev events
			)
			stuck := make(chan struct{})
			t.Cleanup(func() { close(stuck) })
			addComponent(&g, &ev, "a", nil, nil)
			g.Add("stuck", nil, func(ctx context.Context) error { return tc.stop(ctx, stuck) })
			err := runUntilStarted(t, &g, 50*time.Millisecond)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.Contains(t, err.Error(), "stop stuck")
			require.Equal(t, []string{"start a", "stop a"}, ev.get(), "later steps still run")
		})
	}
}

func TestGroup_Run_DefaultStopTimeout(t *testing.T) {
	t.Parallel()
	var (
		g     Group
		dl    time.Time
		hasDL bool
	)
	g.Add("a", nil, func(ctx context.Context) error { dl, hasDL = ctx.Deadline(); return nil })
	begin := time.Now()
	require.NoError(t, runUntilStarted(t, &g, 0))
	end := time.Now()
	require.True(t, hasDL)
	require.False(t, dl.Before(begin.Add(DefaultStopTimeout)), "deadline %v too early", dl)
	require.False(t, dl.After(end.Add(DefaultStopTimeout)), "deadline %v too late", dl)
}

func TestGroup_AddRun_EarlyExit(t *testing.T) {
	t.Parallel()
	errBoom := errors.New("accept failed")
	for _, tc := range []struct {
		name    string
		runErr  error
		wantIs  error
		wantErr string
	}{
		{"error", errBoom, errBoom, "run listener: accept failed"},
		{"nil", nil, ErrExited, "run listener: component exited"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var (
				g  Group
				ev events
			)
			exit := make(chan struct{})
			addComponent(&g, &ev, "a", nil, nil)
			g.AddRun("listener", func(context.Context) error {
				<-exit
				return tc.runErr
			})
			addComponent(&g, &ev, "b", nil, nil)
			g.Add("exit", func(context.Context) error { close(exit); return nil }, nil)

			// ctx is never canceled: the exit alone must shut the group down.
			err := g.Run(t.Context(), time.Second, testutil.Logger(t))
			require.ErrorIs(t, err, tc.wantIs)
			require.EqualError(t, err, tc.wantErr)
			require.Equal(t, []string{"start a", "start b", "stop b", "stop a"}, ev.get())
		})
	}
}

func TestGroup_AddRun_ExitDuringStartup(t *testing.T) {
	t.Parallel()
	var (
		g  Group
		ev events
	)
	errBind := errors.New("bind failed")
	exited := make(chan struct{})
	g.AddRun("listener", func(context.Context) error { defer close(exited); return errBind })
	g.Add("wait", func(context.Context) error { <-exited; return nil }, nil)
	addComponent(&g, &ev, "never", nil, nil)

	err := g.Run(t.Context(), time.Second, testutil.Logger(t))
	require.ErrorIs(t, err, errBind)
	// The exit is seen either before "never" starts or right after; either
	// way whatever started is stopped.
	if got := ev.get(); len(got) > 0 {
		require.Equal(t, []string{"start never", "stop never"}, got)
	}
}

func TestGroup_AddRun_StopErrors(t *testing.T) {
	t.Parallel()
	// stuck is closed when the test ends; a run blocked on it ignores its context.
	stuck := make(chan struct{})
	t.Cleanup(func() { close(stuck) })
	errFlush := errors.New("flush failed")
	for _, tc := range []struct {
		name    string
		run     func(ctx context.Context) error
		stopTO  time.Duration
		wantIs  error
		wantNil bool
	}{
		{"canceled_is_clean", func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }, time.Second, nil, true},
		{"wrapped_canceled_is_clean", func(ctx context.Context) error {
			<-ctx.Done()
			return errors.Join(errors.New("serve"), ctx.Err())
		}, time.Second, nil, true},
		{"nil_is_clean", func(ctx context.Context) error { <-ctx.Done(); return nil }, time.Second, nil, true},
		{"error_on_stop", func(ctx context.Context) error { <-ctx.Done(); return errFlush }, time.Second, errFlush, false},
		{"overrun", func(context.Context) error { <-stuck; return nil }, 20 * time.Millisecond, context.DeadlineExceeded, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var g Group
			g.AddRun("loop", tc.run)
			err := runUntilStarted(t, &g, tc.stopTO)
			if tc.wantNil {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, tc.wantIs)
			require.Contains(t, err.Error(), "stop loop")
		})
	}
}

func TestGroup_Run_StopContext(t *testing.T) {
	t.Parallel()
	type key struct{}
	var (
		g      Group
		hasDL  bool
		ctxErr error
		value  any
	)
	g.Add("a", nil, func(ctx context.Context) error {
		_, hasDL = ctx.Deadline()
		ctxErr = ctx.Err()
		value = ctx.Value(key{})
		return nil
	})
	ctx, cancel := context.WithCancel(context.WithValue(t.Context(), key{}, "v"))
	defer cancel()
	g.Add("cancel", func(context.Context) error { cancel(); return nil }, nil)
	require.NoError(t, g.Run(ctx, time.Second, testutil.Logger(t)))
	require.True(t, hasDL, "stop gets a deadline")
	require.NoError(t, ctxErr, "stop must not get the canceled run context")
	require.Equal(t, "v", value, "stop keeps the run context's values")
}
