package main

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRun_CheckConfig(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "keel-output-kafka"), []byte("#!/bin/sh\n"), 0o755))
	good := filepath.Join(dir, "good.yaml")
	require.NoError(t, os.WriteFile(good, []byte("tenants:\n  acme:\n    rules:\n      - {name: r, filters: [\"a/#\"], sink: {plugin: kafka, config: {brokers: [\"k:9092\"]}}}\n"), 0o600))
	bad := filepath.Join(dir, "bad.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("tenants:\n  acme:\n    rules:\n      - {name: r, filters: [\"a/#/b\"], sink: {plugin: kafka}}\n"), 0o600))

	var out, errb bytes.Buffer
	require.NoError(t, run(t.Context(), []string{"--check-config", "--rules.file", good, "--plugin-dir", dir}, &out, &errb))
	require.Equal(t, "configuration ok: 1 rules\n", out.String())

	t.Setenv("KEEL_RULES_FILE", bad)
	t.Setenv("KEEL_PLUGIN_DIR", dir)
	err := run(t.Context(), []string{"--check-config"}, &out, &errb)
	require.ErrorContains(t, err, "bad.yaml:4: tenants.acme.rules[0].filters[0]")
}
