package service

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/logging"
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
	return c.Start(ctx, &cfg, logger)
}
