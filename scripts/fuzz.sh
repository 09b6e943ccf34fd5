#!/usr/bin/env bash
# Runs every Go fuzz target in the workspace for the given time each.
set -euo pipefail
t=${1:-30s}
cd "$(dirname "$0")/.."
for pkg in $(go list -f '{{if or .TestGoFiles .XTestGoFiles}}{{.Dir}}{{end}}' work); do
  for f in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$pkg"/*_test.go 2>/dev/null | sed 's/^func //' | sort -u); do
    echo "== $pkg $f"
    (cd "$pkg" && go test -run '^$' -fuzz "^$f\$" -fuzztime "$t" .)
  done
done
