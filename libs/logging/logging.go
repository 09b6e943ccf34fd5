// Package logging builds the process logger and holds the attribute keys
// shared by every Keel service.
//
// A main builds one logger with [New] and passes it down through
// constructors; libraries never call [slog.Default]. Components derive their
// own logger with logger.With(logging.KeyComponent, "fsm"). Messages are
// static and lowercase; anything dynamic goes in attributes keyed by the
// constants below.
package logging

import (
	"fmt"
	"io"
	"log/slog"
	"strings"
)

// Attribute keys. Use these rather than string literals so that every service
// logs the same fields under the same names.
const (
	KeyError     = "error"      // an error value; build it with [Err]
	KeyTenant    = "tenant"     // tenant ID
	KeyClientID  = "client_id"  // MQTT client identifier
	KeyEdgeID    = "edge_id"    // edge node ID
	KeyTopic     = "topic"      // MQTT topic name or filter
	KeyRaftIndex = "raft_index" // Raft log index
	KeyComponent = "component"  // component name, kebab-case, set with Logger.With
	KeyRemote    = "remote"     // remote network address
	KeyReason    = "reason"     // why something happened, e.g. a disconnect
)

// Log formats accepted by [New].
const (
	FormatJSON = "json"
	FormatText = "text"
)

// New returns a logger writing to w in the given format, FormatJSON (also
// the default, for "") or FormatText, at the given level as parsed by
// [ParseLevel]. The returned [slog.LevelVar] changes the level at runtime.
func New(w io.Writer, level, format string) (*slog.Logger, *slog.LevelVar, error) {
	lvl, err := ParseLevel(level)
	if err != nil {
		return nil, nil, err
	}
	lv := new(slog.LevelVar)
	lv.Set(lvl)
	opts := &slog.HandlerOptions{Level: lv}

	var h slog.Handler
	switch strings.ToLower(format) {
	case "", FormatJSON:
		h = slog.NewJSONHandler(w, opts)
	case FormatText:
		h = slog.NewTextHandler(w, opts)
	default:
		return nil, nil, fmt.Errorf("%w %q: want %q or %q", ErrInvalidFormat, format, FormatJSON, FormatText)
	}
	return slog.New(h), lv, nil
}

// ParseLevel parses "debug", "info", "warn" (or "warning") or "error", in
// any case. The empty string means info.
func ParseLevel(s string) (slog.Level, error) {
	switch strings.ToLower(s) {
	case "debug":
		return slog.LevelDebug, nil
	case "", "info":
		return slog.LevelInfo, nil
	case "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	default:
		return 0, fmt.Errorf("%w %q: want debug, info, warn or error", ErrInvalidLevel, s)
	}
}

// Err returns the attribute for an error: slog.Any(KeyError, err).
func Err(err error) slog.Attr {
	return slog.Any(KeyError, err)
}

// Discard returns a logger that drops every record. Use it where a logger is
// optional, never as a way to silence a component under test (use
// testutil.Logger there).
func Discard() *slog.Logger {
	return slog.New(slog.DiscardHandler)
}
