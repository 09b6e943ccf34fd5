package logging

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestNew(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, level, format string
		// logs holds whether a Debug, Info, Warn and Error record is written.
		logs [4]bool
		json bool
	}{
		{"defaults", "", "", [4]bool{false, true, true, true}, true},
		{"debug_json", "debug", "json", [4]bool{true, true, true, true}, true},
		{"info_text", "info", "text", [4]bool{false, true, true, true}, false},
		{"warn_upper", "WARN", "TEXT", [4]bool{false, false, true, true}, false},
		{"warning", "warning", "json", [4]bool{false, false, true, true}, true},
		{"error", "error", "json", [4]bool{false, false, false, true}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var buf bytes.Buffer
			logger, lv, err := New(&buf, tc.level, tc.format)
			require.NoError(t, err)
			require.NotNil(t, lv)

			for i, lvl := range []slog.Level{slog.LevelDebug, slog.LevelInfo, slog.LevelWarn, slog.LevelError} {
				buf.Reset()
				logger.Log(t.Context(), lvl, "test message", KeyTenant, "acme")
				if !tc.logs[i] {
					require.Empty(t, buf.String(), "level %s", lvl)
					continue
				}
				require.Contains(t, buf.String(), "test message")
				if tc.json {
					var rec map[string]any
					require.NoError(t, json.Unmarshal(buf.Bytes(), &rec))
					require.Equal(t, "acme", rec[KeyTenant])
					require.Equal(t, lvl.String(), rec[slog.LevelKey])
				} else {
					require.Contains(t, buf.String(), "tenant=acme")
				}
			}
		})
	}
}

func TestNew_LevelVar(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	logger, lv, err := New(&buf, "error", "json")
	require.NoError(t, err)

	logger.Info("hidden")
	require.Empty(t, buf.String())

	lv.Set(slog.LevelDebug)
	logger.Debug("shown")
	require.Contains(t, buf.String(), "shown")
}

func TestNew_Errors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, level, format string
		want                error
	}{
		{"bad_level", "verbose", "json", ErrInvalidLevel},
		{"bad_format", "info", "logfmt", ErrInvalidFormat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			logger, lv, err := New(&bytes.Buffer{}, tc.level, tc.format)
			require.ErrorIs(t, err, tc.want)
			require.Nil(t, logger)
			require.Nil(t, lv)
		})
	}
}

func TestErr(t *testing.T) {
	t.Parallel()
	err := errors.New("boom")
	a := Err(err)
	require.Equal(t, KeyError, a.Key)
	require.Equal(t, err, a.Value.Any())

	var buf bytes.Buffer
	logger, _, _ := New(&buf, "info", "json")
	logger.Error("failed", Err(err))
	var rec map[string]any
	require.NoError(t, json.Unmarshal(buf.Bytes(), &rec))
	require.Equal(t, "boom", rec[KeyError])
}

func TestDiscard(t *testing.T) {
	t.Parallel()
	logger := Discard()
	require.False(t, logger.Enabled(t.Context(), slog.LevelError))
	logger.Error("dropped") // must not panic
}
