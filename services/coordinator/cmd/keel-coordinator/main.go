// Command keel-coordinator runs one node of Keel's Raft group: session
// ownership, membership leases, cluster config, ACL versions and Redis group
// records, served over Connect (gRPC, gRPC-Web and Connect on one port).
package main

import (
	"context"
	"log/slog"

	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/coordinator/internal/app"
)

func main() { service.Main("keel-coordinator", run) }

var run = service.Command[app.Config, *app.Config]{
	Name:    "keel-coordinator",
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
