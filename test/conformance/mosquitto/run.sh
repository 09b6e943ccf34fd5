#!/usr/bin/env bash
# Runs Mosquitto's own broker test suite (test/broker of the Debian source of
# the mosquitto package installed here) against keel-edge.
#
# Every test listed "pass" in tests.txt must pass; the others are listed with
# why they are not run (a mosquitto.conf or password file, a C client built
# from Mosquitto's source, or a behaviour the specification leaves to the
# server where Mosquitto chose otherwise). ALL=1 also runs those and reports
# any that pass, so that tests.txt can be brought up to date.
#
# Environment:
#   KEEL_EDGE   keel-edge binary (default: built into .tmp/)
#   MOSQ_TESTS  where the suite is unpacked (default .tmp/mosquitto-tests)
#   PORT        port of the broker under test (default 21888)
#   ALL=1       run every test, not only those that must pass
#   ONLY=NAME   run one test
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
suite=${MOSQ_TESTS:-$root/.tmp/mosquitto-tests}
port=${PORT:-21888}
say() { echo "mosquitto-suite: $*"; }

if ! command -v python3 >/dev/null; then
	say "SKIPPED: python3 is not installed (make deps installs it)"
	exit 0
fi

# fetch unpacks the suite from the Debian source package of the mosquitto
# that is installed, so the suite matches the broker the benchmarks run.
fetch() {
	local version tmp
	version=$(dpkg-query -W -f '${Version}' mosquitto 2>/dev/null || true)
	if [[ -z $version ]] || ! command -v apt-get >/dev/null; then
		return 1
	fi
	if ! grep -rqs '^Types:.*deb-src\|^deb-src' /etc/apt/sources.list /etc/apt/sources.list.d/; then
		[[ $(id -u) == 0 ]] || return 1
		# The binary sources, as source ones.
		sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
			>/etc/apt/sources.list.d/keel-deb-src.sources 2>/dev/null || return 1
		apt-get update -qq >/dev/null 2>&1 || return 1
	fi
	tmp=$(mktemp -d)
	(cd "$tmp" && apt-get source -qq --download-only "mosquitto=$version" >/dev/null 2>&1) || { rm -rf "$tmp"; return 1; }
	rm -rf "$suite"
	mkdir -p "$suite"
	tar -xzf "$tmp"/mosquitto_*.orig.tar.gz -C "$suite" --strip-components=1 --wildcards '*/test/*'
	rm -rf "$tmp"
	mv "$suite/test/mosq_test.py" "$suite/test/mosq_test.py.orig"
	echo "$version" >"$suite/VERSION"
}

if [[ ! -f $suite/VERSION ]]; then
	say "unpacking the test suite of mosquitto's Debian source"
	if ! fetch; then
		say "SKIPPED: could not get the mosquitto source package (needs mosquitto installed, apt-get and root for deb-src)"
		exit 0
	fi
fi
# The harness with its readers and comparator replaced (adapter.py).
cat "$suite/test/mosq_test.py.orig" "$here/adapter.py" >"$suite/test/mosq_test.py"
mkdir -p "$suite/src"
cp "$here/broker.sh" "$suite/src/mosquitto"
chmod +x "$suite/src/mosquitto"

if [[ -z ${KEEL_EDGE:-} ]]; then
	KEEL_EDGE=$root/.tmp/keel-edge-conformance
	(cd "$root" && "${GO:-go}" build -o "$KEEL_EDGE" ./services/edge/cmd/keel-edge)
fi
export KEEL_EDGE

declare -a run=()
while read -r name verdict _; do
	[[ -z $name || $name == \#* ]] && continue
	if [[ -n ${ONLY:-} ]]; then
		[[ $name == "$ONLY" ]] && run+=("$name:$verdict")
	elif [[ $verdict == pass || -n ${ALL:-} ]]; then
		run+=("$name:$verdict")
	fi
done <"$here/tests.txt"

logs=$root/.tmp/mosquitto-suite-logs
rm -rf "$logs"
mkdir -p "$logs"
passed=0 failed=0 newly=0
failures=()
start=$(date +%s)
for entry in "${run[@]}"; do
	name=${entry%%:*} verdict=${entry#*:}
	if (cd "$suite/test/broker" && timeout 60 python3 "./$name" "$port") >"$logs/$name.log" 2>&1; then
		ok=1
	else
		ok=0
	fi
	# A test that failed may leave its broker behind.
	pkill -f -- "--mqtt.tcp-addr 127.0.0.1:$port " 2>/dev/null || true
	if [[ $verdict == pass ]]; then
		if ((ok)); then
			passed=$((passed + 1))
		else
			failed=$((failed + 1))
			failures+=("$name")
		fi
	elif ((ok)); then
		newly=$((newly + 1))
		say "passes, listed $verdict: $name"
	fi
done
say "${#run[@]} run in $(($(date +%s) - start)) s: $passed passed, $failed failed (suite $(cat "$suite/VERSION"), logs in $logs)"
((newly == 0)) || say "$newly listed as not passing now pass: mark them pass in tests.txt"
for name in "${failures[@]}"; do
	say "FAILED $name:"
	sed 's/^/    /' "$logs/$name.log" | head -n 20
done
((failed == 0))
