#!/usr/bin/env bash
# Runs go test with the given arguments and, when it fails, ends with a digest
# of the failures (test names, assertion messages, file:line of the failing
# checks) so that the reason is at the bottom of a long log, not buried in
# thousands of lines of a failing test's captured logs.
set -uo pipefail
log=$(mktemp "${TMPDIR:-/tmp}/keel-test.XXXXXX")
trap 'rm -f "$log"' EXIT
"${GO:-go}" test "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
	echo
	echo "=== failure digest"
	grep -E -- '--- FAIL|Error Trace:|Error:|Messages:|Test:|^panic:|^FAIL|_test\.go:[0-9]+: |timed out' "$log" |
		grep -v -E 'level=(DEBUG|INFO|WARN)|msg=' | head -n 300
fi
exit "$rc"
