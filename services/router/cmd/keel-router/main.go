// Command keel-router serves the routing table: which edges must receive a
// message published on (tenant, topic), kept in an embedded Olric cluster.
package main

import (
	"context"
	"log/slog"

	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/router/internal/app"
)

func main() { service.Main("keel-router", run) }

var run = service.Command[app.Config, *app.Config]{
	Name:    "keel-router",
	Logging: func(cfg *app.Config) (string, string) { return cfg.LogLevel, cfg.LogFormat },
	Tracing: func(cfg *app.Config) tracing.Config { return cfg.Tracing },
	Start: func(ctx context.Context, cfg *app.Config, logger *slog.Logger) error {
		r, err := app.New(*cfg, logger)
		if err != nil {
			return err
		}
		return r.Run(ctx)
	},
}.Run
