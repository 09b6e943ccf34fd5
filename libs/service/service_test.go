package service

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestMain_ExitCodes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		err        error
		wantCode   int
		wantStderr string
	}{
		{"ok", nil, ExitOK, ""},
		{"help", flag.ErrHelp, ExitUsage, ""},
		{"wrapped_help", fmt.Errorf("parse flags: %w", flag.ErrHelp), ExitUsage, ""},
		{"error", errors.New("listen: address in use"), ExitError, "keel-test: listen: address in use\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var stdout, stderr bytes.Buffer
			var gotArgs []string
			code := runMain("keel-test", func(ctx context.Context, args []string, out, errw io.Writer) error {
				require.NoError(t, ctx.Err())
				require.Same(t, &stdout, out)
				require.Same(t, &stderr, errw)
				gotArgs = args
				return tc.err
			}, []string{"-x", "1"}, &stdout, &stderr)
			require.Equal(t, tc.wantCode, code)
			require.Equal(t, tc.wantStderr, stderr.String())
			require.Equal(t, []string{"-x", "1"}, gotArgs)
		})
	}
}

// TestSignalContext sends SIGTERM to the test process itself. It must not be
// parallel: every SignalContext alive in the process would see the signal.
func TestSignalContext(t *testing.T) {
	ctx, cancel := SignalContext()
	defer cancel()
	require.NoError(t, ctx.Err())

	require.NoError(t, syscall.Kill(syscall.Getpid(), syscall.SIGTERM))
	select {
	case <-ctx.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("context not canceled by SIGTERM")
	}
	require.ErrorIs(t, ctx.Err(), context.Canceled)
	require.Contains(t, context.Cause(ctx).Error(), "terminated")
}

func TestSignalContext_Cancel(t *testing.T) {
	ctx, cancel := SignalContext()
	cancel()
	require.ErrorIs(t, ctx.Err(), context.Canceled)
}
