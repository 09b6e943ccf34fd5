// Command keel-edge serves MQTT 3.1, 3.1.1 and 5.0 clients over TCP, TLS,
// WebSocket and secure WebSocket.
package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/edge/internal/app"
	"github.com/keelmq/keel/services/edge/internal/gcfloor"
)

func main() { service.Main("keel-edge", run) }

var run = service.Command[app.Config, *app.Config]{
	Name:    "keel-edge",
	Logging: func(cfg *app.Config) (string, string) { return cfg.LogLevel, cfg.LogFormat },
	Tracing: func(cfg *app.Config) tracing.Config { return cfg.Tracing },
	Start: func(ctx context.Context, cfg *app.Config, logger *slog.Logger) error {
		if os.Getenv("GOGC") == "" {
			defer gcfloor.Keep(cfg.GCHeapFloor, 100).Stop()
		}
		edge, err := app.New(*cfg, logger)
		if err != nil {
			return err
		}
		return edge.Run(ctx)
	},
}.Run
