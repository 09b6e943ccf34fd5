package config

import (
	"errors"
	"flag"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestEnvName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, flag, want string
	}{
		{"plain", "addr", "KEEL_ADDR"},
		{"dot_and_dash", "mqtt.tcp-addr", "KEEL_MQTT_TCP_ADDR"},
		{"mixed_case", "raft.heartbeatTimeout", "KEEL_RAFT_HEARTBEATTIMEOUT"},
		{"nested", "a.b.c-d-e", "KEEL_A_B_C_D_E"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, EnvName(tc.flag))
		})
	}
}

type testConfig struct {
	Addr    string
	Port    int
	Debug   bool
	Timeout time.Duration
	Topics  StringList
}

func newTestFlagSet(c *testConfig) *flag.FlagSet {
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&c.Addr, "mqtt.tcp-addr", ":1883", "")
	fs.IntVar(&c.Port, "ops.port", 9000, "")
	fs.BoolVar(&c.Debug, "debug", false, "")
	fs.DurationVar(&c.Timeout, "stop-timeout", 5*time.Second, "")
	c.Topics = StringList{"default/a", "default/b"}
	fs.Var(&c.Topics, "topics", "")
	return fs
}

func mapEnv(env map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := env[k]
		return v, ok
	}
}

func TestParse_Precedence(t *testing.T) {
	t.Parallel()
	defaults := testConfig{
		Addr:    ":1883",
		Port:    9000,
		Timeout: 5 * time.Second,
		Topics:  StringList{"default/a", "default/b"},
	}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want func(c *testConfig)
	}{
		{
			name: "defaults",
			want: func(*testConfig) {},
		},
		{
			name: "env_over_default",
			env: map[string]string{
				"KEEL_MQTT_TCP_ADDR":   ":1999",
				"KEEL_OPS_PORT":        "1234",
				"KEEL_DEBUG":           "true",
				"KEEL_STOP_TIMEOUT":    "2s",
				"KEEL_TOPICS":          "x, y,,z",
				"KEEL_UNRELATED_THING": "ignored",
			},
			want: func(c *testConfig) {
				c.Addr, c.Port, c.Debug, c.Timeout = ":1999", 1234, true, 2*time.Second
				c.Topics = StringList{"x", "y", "z"}
			},
		},
		{
			name: "flag_over_env",
			args: []string{"-mqtt.tcp-addr=:2000", "-topics", "f1", "-topics", "f2,f3"},
			env: map[string]string{
				"KEEL_MQTT_TCP_ADDR": ":1999",
				"KEEL_TOPICS":        "x",
				"KEEL_OPS_PORT":      "1234",
			},
			want: func(c *testConfig) {
				c.Addr, c.Port = ":2000", 1234
				c.Topics = StringList{"f1", "f2", "f3"}
			},
		},
		{
			name: "flag_set_to_default_value_still_wins",
			args: []string{"-ops.port=9000"},
			env:  map[string]string{"KEEL_OPS_PORT": "1"},
			want: func(*testConfig) {},
		},
		{
			name: "empty_env_clears_string",
			env:  map[string]string{"KEEL_MQTT_TCP_ADDR": "", "KEEL_TOPICS": ""},
			want: func(c *testConfig) {
				c.Addr = ""
				c.Topics = nil
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var got testConfig
			fs := newTestFlagSet(&got)
			require.NoError(t, parse(fs, tc.args, mapEnv(tc.env)))

			want := defaults
			want.Topics = append(StringList(nil), defaults.Topics...)
			tc.want(&want)
			require.Equal(t, want, got)
		})
	}
}

func TestParse_Errors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		args     []string
		env      map[string]string
		is       error
		contains []string
	}{
		{
			name:     "bad_int_env",
			env:      map[string]string{"KEEL_OPS_PORT": "nope"},
			is:       ErrInvalidEnv,
			contains: []string{"KEEL_OPS_PORT", "-ops.port"},
		},
		{
			name:     "bad_bool_and_duration_env",
			env:      map[string]string{"KEEL_DEBUG": "maybe", "KEEL_STOP_TIMEOUT": "soon"},
			is:       ErrInvalidEnv,
			contains: []string{"KEEL_DEBUG", "KEEL_STOP_TIMEOUT"},
		},
		{
			name: "help",
			args: []string{"-h"},
			is:   flag.ErrHelp,
		},
		{
			name:     "unknown_flag",
			args:     []string{"-nope"},
			contains: []string{"nope"},
		},
		{
			name:     "bad_flag_value",
			args:     []string{"-ops.port=x"},
			contains: []string{"ops.port"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var c testConfig
			err := parse(newTestFlagSet(&c), tc.args, mapEnv(tc.env))
			require.Error(t, err)
			if tc.is != nil {
				require.ErrorIs(t, err, tc.is)
			}
			for _, s := range tc.contains {
				require.Contains(t, err.Error(), s)
			}
		})
	}
}

func TestParse_BadEnvValueNotInError(t *testing.T) {
	t.Parallel()
	var c testConfig
	err := parse(newTestFlagSet(&c), nil, mapEnv(map[string]string{"KEEL_OPS_PORT": "s3cr3t"}))
	require.ErrorIs(t, err, ErrInvalidEnv)
	require.NotContains(t, err.Error(), "s3cr3t")
	require.False(t, errors.Is(err, flag.ErrHelp))
}

// TestParse_Environment checks the exported Parse against the real process
// environment; it cannot run in parallel because of t.Setenv.
func TestParse_Environment(t *testing.T) {
	t.Setenv("KEEL_MQTT_TCP_ADDR", ":7777")
	t.Setenv("KEEL_OPS_PORT", "1")
	var c testConfig
	require.NoError(t, Parse(newTestFlagSet(&c), []string{"-ops.port=2"}))
	require.Equal(t, ":7777", c.Addr)
	require.Equal(t, 2, c.Port)
}

func TestStringList_Set(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		initial StringList
		sets    []string
		want    StringList
		str     string
	}{
		{"single", nil, []string{"a"}, StringList{"a"}, "a"},
		{"comma_separated", nil, []string{"a,b , c"}, StringList{"a", "b", "c"}, "a,b,c"},
		{"repeated", nil, []string{"a", "b,c"}, StringList{"a", "b", "c"}, "a,b,c"},
		{"empty_elements_dropped", nil, []string{",a,,", " "}, StringList{"a"}, "a"},
		{"appends", StringList{"x"}, []string{"y"}, StringList{"x", "y"}, "x,y"},
		{"empty", nil, nil, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			l := tc.initial
			for _, s := range tc.sets {
				require.NoError(t, l.Set(s))
			}
			require.Equal(t, tc.want, l)
			require.Equal(t, tc.str, l.String())
			require.Equal(t, []string(tc.want), l.Get())
		})
	}
}

func TestStringList_SetDoesNotAliasDefault(t *testing.T) {
	t.Parallel()
	backing := make([]string, 1, 4)
	backing[0] = "a"
	l := StringList(backing)
	require.NoError(t, l.Set("b"))
	require.Equal(t, StringList{"a", "b"}, l)
	require.Equal(t, []string{"a", "", "", ""}, backing[:4])
}

func TestStringList_NilString(t *testing.T) {
	t.Parallel()
	var l *StringList
	require.Empty(t, l.String())
}
