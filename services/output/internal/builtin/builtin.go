// Package builtin maps the IDs of the plugins shipped with Keel to their
// implementations, for the plugin binaries' mains (cmd/keel-output-<id>) and
// for tests that run the same code from a re-executed test binary.
package builtin

import (
	"fmt"
	"log/slog"
	"os"
	"runtime/pprof"
	"sort"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/services/output/internal/pluginkit"
	"github.com/keelmq/keel/services/output/internal/sink/httpsink"
	"github.com/keelmq/keel/services/output/internal/sink/kafkasink"
	"github.com/keelmq/keel/services/output/internal/transform/filter"
	"github.com/keelmq/keel/services/output/internal/transform/jsonmap"
)

// LogLevelEnv sets a plugin process's log level (debug, info, warn, error).
const LogLevelEnv = "KEEL_PLUGIN_LOG_LEVEL"

// CPUProfileEnv, when set to a path prefix, makes a plugin process write a
// CPU profile to "<prefix>.<id>.<pid>" while it serves (the profile is
// complete once the host stopped the plugin gracefully). For profiling the
// plugin side of a pipeline; the host sets it in its own environment, which
// plugins inherit.
const CPUProfileEnv = "KEEL_PLUGIN_CPUPROFILE"

var serveFns = map[string]func(*slog.Logger){
	kafkasink.ID: func(l *slog.Logger) { pluginkit.ServeSink(kafkasink.New(l)) },
	httpsink.ID:  func(l *slog.Logger) { pluginkit.ServeSink(httpsink.New(l)) },
	filter.ID:    func(*slog.Logger) { pluginkit.ServeTransform(filter.New()) },
	jsonmap.ID:   func(*slog.Logger) { pluginkit.ServeTransform(jsonmap.New()) },
}

// IDs lists the built-in plugin IDs, sorted.
func IDs() []string {
	ids := make([]string, 0, len(serveFns))
	for id := range serveFns {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// Serve serves plugin id in this process until the host ends it. It returns
// an error only for an unknown ID.
func Serve(id string) error {
	fn, ok := serveFns[id]
	if !ok {
		return fmt.Errorf("unknown plugin %q (built in: %v)", id, IDs())
	}
	lvl, err := logging.ParseLevel(os.Getenv(LogLevelEnv))
	if err != nil {
		lvl = slog.LevelInfo
	}
	logger := pluginkit.PluginLogger(lvl).With("plugin", id)
	if prefix := os.Getenv(CPUProfileEnv); prefix != "" {
		stop, err := startCPUProfile(fmt.Sprintf("%s.%s.%d", prefix, id, os.Getpid()))
		if err != nil {
			logger.Warn("cpu profile not started", logging.Err(err))
		} else {
			defer stop()
		}
	}
	fn(logger)
	return nil
}

func startCPUProfile(path string) (func(), error) {
	f, err := os.Create(path) //nolint:gosec // operator-chosen profiling path
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); _ = f.Close() }, nil
}

// Main is the whole main function of a plugin binary.
func Main(id string) {
	if err := Serve(id); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
