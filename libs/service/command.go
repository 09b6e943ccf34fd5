package service

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/libs/tracing"
)

// Configurable is the configuration of a service binary.
type Configurable interface {
	RegisterFlags(fs *flag.FlagSet)
	Validate() error
}

// Command describes a service binary for [Command.Run]: how to read its
// log settings, start it, and (optionally) check more than the flags under
// --check-config.
type Command[C any, P interface {
	*C
	Configurable
}] struct {
	Name string
	// Logging returns the log level and format from the configuration.
	Logging func(cfg *C) (level, format string)
	// Start builds and runs the service until ctx ends.
	Start func(ctx context.Context, cfg *C, logger *slog.Logger) error
	// Check, when set, runs under --check-config after Validate and prints
	// what it checked.
	Check func(cfg *C, stdout io.Writer) error
	// Tracing, when set, returns the tracing configuration: Run installs
	// the tracer provider (when the OTLP environment asks for one) before
	// Start and flushes it after.
	Tracing func(cfg *C) tracing.Config
}

// Run is the run function [Main] takes: flags (with KEEL_* environment
// variables), validation, --check-config, a JSON or text logger, then Start.
func (c Command[C, P]) Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet(c.Name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cfg C
	P(&cfg).RegisterFlags(fs)
	checkOnly := fs.Bool("check-config", false, "validate the configuration and exit")
	if err := config.Parse(fs, args); err != nil {
		return err
	}
	if err := P(&cfg).Validate(); err != nil {
		return fmt.Errorf("invalid configuration: %w", err)
	}
	if *checkOnly {
		if c.Check != nil {
			return c.Check(&cfg, stdout)
		}
		_, _ = fmt.Fprintln(stdout, "configuration ok")
		return nil
	}
	level, format := c.Logging(&cfg)
	logger, _, err := logging.New(stderr, level, format)
	if err != nil {
		return err
	}
	if c.Tracing != nil {
		shutdown, err := tracing.Setup(ctx, c.Name, c.Tracing(&cfg), logger.With("component", "tracing"))
		if err != nil {
			return err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), tracingFlushTimeout)
			defer cancel()
			if err := shutdown(sctx); err != nil {
				logger.Warn("tracing flush failed", "error", err)
			}
		}()
	}
	return c.Start(ctx, &cfg, logger)
}

// tracingFlushTimeout bounds the export of the last spans at exit.
const tracingFlushTimeout = 5 * time.Second
