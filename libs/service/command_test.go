package service

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
)

type testConfig struct {
	Name     string
	LogLevel string
}

func (c *testConfig) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Name, "name", "", "a name")
	fs.StringVar(&c.LogLevel, "log.level", "info", "log level")
}

func (c *testConfig) Validate() error {
	if c.Name == "" {
		return errors.New("name is required")
	}
	return nil
}

func TestCommand_Run(t *testing.T) {
	var started *testConfig
	cmd := Command[testConfig, *testConfig]{
		Name:    "test",
		Logging: func(c *testConfig) (string, string) { return c.LogLevel, "text" },
		Start: func(_ context.Context, c *testConfig, _ *slog.Logger) error {
			started = c
			return nil
		},
	}
	var out bytes.Buffer
	require.NoError(t, cmd.Run(t.Context(), []string{"--name", "x"}, &out, io.Discard))
	require.Equal(t, "x", started.Name)

	t.Setenv("KEEL_NAME", "from-env")
	require.NoError(t, cmd.Run(t.Context(), nil, &out, io.Discard))
	require.Equal(t, "from-env", started.Name, "KEEL_* environment variables apply")

	started = nil
	require.NoError(t, cmd.Run(t.Context(), []string{"--check-config"}, &out, io.Discard))
	require.Nil(t, started, "--check-config does not start")
	require.Contains(t, out.String(), "configuration ok")

	t.Setenv("KEEL_NAME", "")
	require.ErrorContains(t, cmd.Run(t.Context(), nil, &out, io.Discard), "invalid configuration: name is required")
	require.Error(t, cmd.Run(t.Context(), []string{"--log.level", "loud", "--name", "x"}, &out, io.Discard))
}
