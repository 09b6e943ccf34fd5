// Command keel-output runs the output service: edges stream MQTT messages to
// it, and it sends them through per-tenant rules (topic filters → transform
// plugins → sink plugin) to Kafka/Redpanda, HTTP endpoints and more.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/services/output/internal/app"
)

func main() { service.Main("keel-output", run) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("keel-output", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg app.Config
	cfg.RegisterFlags(fs)
	checkOnly := fs.Bool("check-config", false, "validate the configuration and the rules file, then exit")
	if err := config.Parse(fs, args); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("invalid configuration: %w", err)
	}
	if *checkOnly {
		set, err := cfg.CheckRules()
		if err != nil {
			return err
		}
		_, _ = fmt.Fprintf(stdout, "configuration ok: %d rules\n", len(set.Pipelines))
		return nil
	}
	logger, _, err := logging.New(stderr, cfg.LogLevel, cfg.LogFormat)
	if err != nil {
		return err
	}
	out, err := app.New(cfg, logger)
	if err != nil {
		return err
	}
	return out.Run(ctx)
}
