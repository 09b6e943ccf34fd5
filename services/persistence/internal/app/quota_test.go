package app

import (
	"flag"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/persistence/internal/store"
)

// TestConfig_TenantQuotas: --queue.tenant-max and --queue.tenant-max-for
// give each tenant its bound; a malformed entry is refused by Validate.
func TestConfig_TenantQuotas(t *testing.T) {
	parse := func(args ...string) *Config {
		t.Helper()
		var c Config
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		c.RegisterFlags(fs)
		require.NoError(t, fs.Parse(args))
		return &c
	}
	q, err := parse("--queue.tenant-max", "1000", "--queue.tenant-max-for", "acme=5,big=0").TenantQuotas()
	require.NoError(t, err)
	require.Equal(t, store.TenantQuotas{Default: 1000, For: map[string]int{"acme": 5, "big": 0}}, q)
	require.Equal(t, 5, q.Max("acme"))
	require.Equal(t, 0, q.Max("big"))
	require.Equal(t, 1000, q.Max("other"))
	for _, bad := range []string{"acme", "acme=-1", "acme=x", "BAD!=3", "=3"} {
		c := parse("--queue.tenant-max-for", bad)
		_, err := c.TenantQuotas()
		require.Error(t, err, bad)
		require.ErrorContains(t, c.Validate(), "queue.tenant-max-for", bad)
	}
	require.ErrorContains(t, parse("--queue.tenant-max", "-1").Validate(), "queue.tenant-max")
}
