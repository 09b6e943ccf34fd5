// Command keel-persistence serves Keel's durable MQTT state (sessions,
// queues, in-flight deliveries, retained messages) over Connect, on a Redis
// group it fails over through the coordinator, or on an embedded store.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/service"
	"github.com/keelmq/keel/services/persistence/internal/app"
)

func main() { service.Main("keel-persistence", run) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("keel-persistence", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg app.Config
	cfg.RegisterFlags(fs)
	checkOnly := fs.Bool("check-config", false, "validate the configuration and exit")
	if err := config.Parse(fs, args); err != nil {
		return err
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("invalid configuration: %w", err)
	}
	if *checkOnly {
		_, _ = fmt.Fprintln(stdout, "configuration ok")
		return nil
	}
	logger, _, err := logging.New(stderr, cfg.LogLevel, cfg.LogFormat)
	if err != nil {
		return err
	}
	a, err := app.New(cfg, logger)
	if err != nil {
		return err
	}
	return a.Run(ctx)
}
