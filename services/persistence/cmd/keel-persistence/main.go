// Command keel-persistence serves Keel's durable MQTT state (sessions,
// queues, in-flight deliveries, retained messages) over Connect, on a Redis
// group it fails over through the coordinator, or on an embedded store.
package main

import (
	"context"
	"log/slog"

	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/persistence/internal/app"
)

func main() { service.Main("keel-persistence", run) }

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
