// Command keel-output runs the output service: edges stream MQTT messages to
// it, and it sends them through per-tenant rules (topic filters → transform
// plugins → sink plugin) to Kafka/Redpanda, HTTP endpoints and more.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/libs/tracing"
	"github.com/keelmq/keel/services/output/internal/app"
)

func main() { service.Main("keel-output", run) }

var run = service.Command[app.Config, *app.Config]{
	Name:    "keel-output",
	Logging: func(cfg *app.Config) (string, string) { return cfg.LogLevel, cfg.LogFormat },
	Tracing: func(cfg *app.Config) tracing.Config { return cfg.Tracing },
	Start: func(ctx context.Context, cfg *app.Config, logger *slog.Logger) error {
		out, err := app.New(*cfg, logger)
		if err != nil {
			return err
		}
		return out.Run(ctx)
	},
	Check: func(cfg *app.Config, stdout io.Writer) error {
		set, err := cfg.CheckRules()
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(stdout, "configuration ok: %d rules\n", len(set.Pipelines))
		return err
	},
}.Run
