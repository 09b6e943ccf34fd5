package raftnode

import (
	"context"
	"io"
	"log"
	"log/slog"

	"github.com/hashicorp/go-hclog"
)

// hclogAdapter lets hashicorp/raft and memberlist log through our slog logger.
// Raft's Info is mapped to slog Info, its Trace to Debug-4.
type hclogAdapter struct {
	l       *slog.Logger
	name    string
	implied []any
}

// NewHCLogger returns an hclog.Logger that writes to l.
func NewHCLogger(l *slog.Logger) hclog.Logger { return &hclogAdapter{l: l} }

var _ hclog.Logger = (*hclogAdapter)(nil)

func slogLevel(l hclog.Level) slog.Level {
	switch l {
	case hclog.Trace:
		return slog.LevelDebug - 4
	case hclog.Debug:
		return slog.LevelDebug
	case hclog.Warn:
		return slog.LevelWarn
	case hclog.Error:
		return slog.LevelError
	default:
		return slog.LevelInfo
	}
}

func (a *hclogAdapter) Log(level hclog.Level, msg string, args ...any) {
	lvl := slogLevel(level)
	ctx := context.Background()
	if !a.l.Enabled(ctx, lvl) {
		return
	}
	a.l.Log(ctx, lvl, msg, args...)
}
func (a *hclogAdapter) Trace(msg string, args ...any) { a.Log(hclog.Trace, msg, args...) }
func (a *hclogAdapter) Debug(msg string, args ...any) { a.Log(hclog.Debug, msg, args...) }
func (a *hclogAdapter) Info(msg string, args ...any)  { a.Log(hclog.Info, msg, args...) }
func (a *hclogAdapter) Warn(msg string, args ...any)  { a.Log(hclog.Warn, msg, args...) }
func (a *hclogAdapter) Error(msg string, args ...any) { a.Log(hclog.Error, msg, args...) }
func (a *hclogAdapter) IsTrace() bool {
	return a.l.Enabled(context.Background(), slog.LevelDebug-4)
}
func (a *hclogAdapter) IsDebug() bool      { return a.l.Enabled(context.Background(), slog.LevelDebug) }
func (a *hclogAdapter) IsInfo() bool       { return a.l.Enabled(context.Background(), slog.LevelInfo) }
func (a *hclogAdapter) IsWarn() bool       { return a.l.Enabled(context.Background(), slog.LevelWarn) }
func (a *hclogAdapter) IsError() bool      { return a.l.Enabled(context.Background(), slog.LevelError) }
func (a *hclogAdapter) ImpliedArgs() []any { return a.implied }
func (a *hclogAdapter) With(args ...any) hclog.Logger {
	return &hclogAdapter{l: a.l.With(args...), name: a.name, implied: append(append([]any(nil), a.implied...), args...)}
}
func (a *hclogAdapter) Name() string { return a.name }
func (a *hclogAdapter) Named(name string) hclog.Logger {
	if a.name != "" {
		name = a.name + "." + name
	}
	return a.ResetNamed(name)
}
func (a *hclogAdapter) ResetNamed(name string) hclog.Logger {
	return &hclogAdapter{l: a.l.With("subsystem", name), name: name, implied: a.implied}
}
func (a *hclogAdapter) SetLevel(hclog.Level) {}
func (a *hclogAdapter) GetLevel() hclog.Level {
	switch {
	case a.IsTrace():
		return hclog.Trace
	case a.IsDebug():
		return hclog.Debug
	case a.IsInfo():
		return hclog.Info
	case a.IsWarn():
		return hclog.Warn
	default:
		return hclog.Error
	}
}
func (a *hclogAdapter) StandardLogger(opts *hclog.StandardLoggerOptions) *log.Logger {
	return log.New(a.StandardWriter(opts), "", 0)
}
func (a *hclogAdapter) StandardWriter(*hclog.StandardLoggerOptions) io.Writer {
	return slog.NewLogLogger(a.l.Handler(), slog.LevelInfo).Writer()
}
