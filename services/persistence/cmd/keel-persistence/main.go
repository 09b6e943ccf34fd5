// Command keel-persistence serves Keel's durable MQTT state (sessions,
// queues, in-flight deliveries, retained messages) over Connect, on a Redis
// group it fails over through the coordinator, or on an embedded store.
package main

import (
	"context"
	"log/slog"
	"os"
	"runtime/debug"

	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/persistence/internal/app"
)

// gcPercent is the service's GOGC unless the environment sets one. It holds
// little (the writes in flight and their buffers) and allocates for every
// record it passes on: collecting four times less often costs a few MiB
// and saves about a fifth of its CPU (BenchmarkServer_Write: 6.7-7.2 µs of
// CPU per record at GOGC=100, 5.3 at 400).
const gcPercent = 400

func main() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(gcPercent)
	}
	service.Main("keel-persistence", run)
}

var run = service.Command[app.Config, *app.Config]{
	Name:    "keel-persistence",
	Logging: func(cfg *app.Config) (string, string) { return cfg.LogLevel, cfg.LogFormat },
	Tracing: func(cfg *app.Config) tracing.Config { return cfg.Tracing },
	Start: func(ctx context.Context, cfg *app.Config, logger *slog.Logger) error {
		a, err := app.New(*cfg, logger)
		if err != nil {
			return err
		}
		return a.Run(ctx)
	},
}.Run
