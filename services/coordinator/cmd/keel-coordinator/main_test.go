package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRun_CheckConfig(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"-check-config"}, &out, &errOut))
	require.Contains(t, out.String(), "configuration ok")

	t.Setenv("KEEL_LEASE_TTL", "1ms")
	err := run(t.Context(), []string{"-check-config"}, &out, &errOut)
	require.ErrorContains(t, err, "lease ttl")
}
