package pluginkit

import (
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"

	"github.com/hashicorp/go-hclog"
)

// hcLogger adapts a *slog.Logger to hclog.Logger, which go-plugin requires.
// Plugin stderr lines reach it already parsed (level, message, attributes).
type hcLogger struct {
	l     *slog.Logger
	name  string
	args  []any
	level hclog.Level
}

var _ hclog.Logger = (*hcLogger)(nil)

func newHCLogger(l *slog.Logger) hclog.Logger {
	return &hcLogger{l: l, level: hclog.Debug}
}

func toSlog(level hclog.Level) slog.Level {
	switch level {
	case hclog.Trace, hclog.Debug:
		return slog.LevelDebug
	case hclog.Warn:
		return slog.LevelWarn
	case hclog.Error:
		return slog.LevelError
	default:
		return slog.LevelInfo
	}
}

func (h *hcLogger) Log(level hclog.Level, msg string, args ...any) {
	lv := toSlog(level)
	if !h.l.Enabled(context.Background(), lv) {
		return
	}
	h.l.Log(context.Background(), lv, msg, append(h.args[:len(h.args):len(h.args)], args...)...)
}
func (h *hcLogger) Trace(msg string, args ...any) { h.Log(hclog.Trace, msg, args...) }
func (h *hcLogger) Debug(msg string, args ...any) { h.Log(hclog.Debug, msg, args...) }
func (h *hcLogger) Info(msg string, args ...any)  { h.Log(hclog.Info, msg, args...) }
func (h *hcLogger) Warn(msg string, args ...any)  { h.Log(hclog.Warn, msg, args...) }
func (h *hcLogger) Error(msg string, args ...any) { h.Log(hclog.Error, msg, args...) }
func (h *hcLogger) enabled(l hclog.Level) bool {
	return h.l.Enabled(context.Background(), toSlog(l))
}
func (h *hcLogger) IsTrace() bool        { return h.enabled(hclog.Trace) }
func (h *hcLogger) IsDebug() bool        { return h.enabled(hclog.Debug) }
func (h *hcLogger) IsInfo() bool         { return h.enabled(hclog.Info) }
func (h *hcLogger) IsWarn() bool         { return h.enabled(hclog.Warn) }
func (h *hcLogger) IsError() bool        { return h.enabled(hclog.Error) }
func (h *hcLogger) ImpliedArgs() []any   { return h.args }
func (h *hcLogger) Name() string         { return h.name }
func (h *hcLogger) SetLevel(hclog.Level) {}
func (h *hcLogger) GetLevel() hclog.Level {
	for _, l := range []hclog.Level{hclog.Debug, hclog.Info, hclog.Warn, hclog.Error} {
		if h.enabled(l) {
			return l
		}
	}
	return hclog.Off
}
func (h *hcLogger) With(args ...any) hclog.Logger {
	c := *h
	c.args = append(h.args[:len(h.args):len(h.args)], args...)
	return &c
}
func (h *hcLogger) Named(name string) hclog.Logger {
	if h.name != "" {
		name = h.name + "." + name
	}
	return h.ResetNamed(name)
}
func (h *hcLogger) ResetNamed(name string) hclog.Logger {
	c := *h
	c.name = name
	c.l = h.l.With("plugin_log", name)
	return &c
}
func (h *hcLogger) StandardLogger(*hclog.StandardLoggerOptions) *log.Logger {
	return slog.NewLogLogger(h.l.Handler(), slog.LevelInfo)
}
func (h *hcLogger) StandardWriter(*hclog.StandardLoggerOptions) io.Writer {
	return writerFunc(func(p []byte) (int, error) {
		h.l.Info(fmt.Sprintf("%s", p))
		return len(p), nil
	})
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
