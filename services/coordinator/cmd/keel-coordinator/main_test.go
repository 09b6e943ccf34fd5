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

func TestRun_RouterURLFromEnv(t *testing.T) {
	var out, errOut bytes.Buffer
	t.Setenv("KEEL_ROUTER_URL", "keel-router:9300")
	require.ErrorContains(t, run(t.Context(), []string{"-check-config"}, &out, &errOut), "router url")

	t.Setenv("KEEL_ROUTER_URL", "http://keel-router:9300")
	t.Setenv("KEEL_CUSTODY_ROUTE_GRACE", "-1s")
	require.ErrorContains(t, run(t.Context(), []string{"-check-config"}, &out, &errOut), "route grace")

	t.Setenv("KEEL_CUSTODY_ROUTE_GRACE", "2s")
	require.NoError(t, run(t.Context(), []string{"-check-config"}, &out, &errOut))
}
