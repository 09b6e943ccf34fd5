package conformance

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// pahoModule is the Eclipse Paho MQTT 3.1.1 client for Go. Its module ships
// the functional verification tests (fvt_client_test.go) that the Paho
// project runs against Mosquitto and IBM MessageSight: a third-party suite,
// written to the specification and to what brokers do, not to Keel.
const pahoModule = "github.com/eclipse/paho.mqtt.golang"

// TestPahoFVT runs every functional verification test of the Paho Go client
// (at the version this module requires, from the Go module cache) against a
// keel-edge. The suite dials port 1883 of the host named by TEST_FVT_ADDR,
// so the edge listens on 1883 of a loopback address of its own (127.0.0.N).
// Its results are the suite's own: a Paho test that fails three runs in a
// row fails this test, and the suite's output is logged.
//
// The edge runs with the topic limits of the specification (65,535 bytes,
// no level cap): Test_OverLengthTopic publishes a topic of exactly 65,535
// bytes, which Keel's defaults refuse.
func TestPahoFVT(t *testing.T) {
	skipIfExternal(t, "the Paho suite dials port 1883 of the broker's host")
	if suite.skip != "" {
		t.Skip(suite.skip)
	}
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "the Paho suite is run with the go command")

	dir := pahoModuleDir(t, goBin)
	tests := pahoFVTTests(t, filepath.Join(dir, "fvt_client_test.go"))
	t.Logf("%s: %d functional verification tests in %s", pahoModule, len(tests), dir)

	host := loopbackWithFreePort(t, 1883)
	e := startEdgeAt(t, net.JoinHostPort(host, "1883"),
		"--mqtt.max-topic-length", "65535", "--mqtt.max-topic-levels", "0", "--log.level", "info")
	require.Equal(t, net.JoinHostPort(host, "1883"), e.TCP)

	// A failed test runs again, twice at most: a few of the suite's tests
	// race one client's SUBSCRIBE against another client's PUBLISH sent
	// right after it on another connection, which MQTT does not order
	// (Test_ResumeSubs). One that fails every time fails this test.
	passed, failed, out, err := runPaho(t, goBin, host, tests)
	for attempt := 2; attempt <= 3 && len(failed) > 0; attempt++ {
		t.Logf("Paho FVT: %v failed; running them again (attempt %d)", failed, attempt)
		var again []string
		again, failed, out, err = runPaho(t, goBin, host, failed)
		passed = append(passed, again...)
	}
	t.Logf("Paho FVT against keel-edge: %d of %d passed", len(passed), len(tests))
	if len(failed) > 0 || len(passed) != len(tests) {
		t.Logf("go test %s output:\n%s", pahoModule, out)
		t.Fatalf("Paho FVT: %v; failed: %v; passed %d of %d", err, failed, len(passed), len(tests))
	}
}

// runPaho runs the named tests of the Paho suite against the broker on
// port 1883 of host and returns the ones that passed and failed, and the
// suite's output.
func runPaho(t *testing.T, goBin, host string, tests []string) (passed, failed []string, out string, err error) {
	t.Helper()
	run := regexp.QuoteMeta(strings.Join(tests, "|"))
	run = "^(" + strings.ReplaceAll(run, `\|`, "|") + ")$"
	cmd := exec.Command(goBin, "test", "-count=1", "-timeout", "10m", "-v", "-run", run, pahoModule)
	cmd.Dir = "." // this module: its go.sum pins the Paho version
	cmd.Env = append(os.Environ(), "TEST_FVT_ADDR="+host)
	var buf bytes.Buffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	start := time.Now()
	err = cmd.Run()
	passed, failed = pahoResults(buf.String())
	t.Logf("ran %d Paho tests in %s: %d passed, %d failed", len(tests), time.Since(start).Round(time.Millisecond), len(passed), len(failed))
	if err != nil && len(failed) == 0 {
		// The suite did not run (a build failure, a timeout): everything failed.
		failed = tests
	}
	return passed, failed, buf.String(), err
}

// pahoModuleDir returns the directory of the Paho module's source, downloaded
// into the module cache when it is not there yet.
func pahoModuleDir(t *testing.T, goBin string) string {
	t.Helper()
	cmd := exec.Command(goBin, "mod", "download", "-json", pahoModule)
	out, err := cmd.Output()
	require.NoError(t, err, "go mod download %s", pahoModule)
	m := regexp.MustCompile(`"Dir":\s*"([^"]+)"`).FindSubmatch(out)
	require.NotNil(t, m, "no Dir in: %s", out)
	return string(m[1])
}

// pahoFVTTests lists the test functions of the Paho suite's file, so that a
// newer Paho version's tests are run without a list kept here.
func pahoFVTTests(t *testing.T, file string) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.SkipObjectResolution)
	require.NoError(t, err)
	var names []string
	for _, d := range f.Decls {
		fn, ok := d.(*ast.FuncDecl)
		if ok && fn.Recv == nil && strings.HasPrefix(fn.Name.Name, "Test") {
			names = append(names, fn.Name.Name)
		}
	}
	require.NotEmpty(t, names, "no tests in %s", file)
	sort.Strings(names)
	return names
}

var pahoResultLine = regexp.MustCompile(`(?m)^\s*--- (PASS|FAIL|SKIP): (\S+)`)

// pahoResults reads the top-level test results from go test -v output.
func pahoResults(out string) (passed, failed []string) {
	for _, m := range pahoResultLine.FindAllStringSubmatch(out, -1) {
		if strings.Contains(m[2], "/") {
			continue
		}
		switch m[1] {
		case "PASS":
			passed = append(passed, m[2])
		case "FAIL":
			failed = append(failed, m[2])
		case "SKIP":
			failed = append(failed, m[2]+" (skipped)")
		}
	}
	return passed, failed
}

// loopbackWithFreePort returns a loopback address 127.0.0.N (N ≥ 2) on which
// port is free a moment ago.
func loopbackWithFreePort(t *testing.T, port int) string {
	t.Helper()
	start := int(time.Now().UnixNano()%200) + 2
	for i := range 250 {
		host := fmt.Sprintf("127.0.0.%d", (start+i)%250+2)
		l, err := net.Listen("tcp", net.JoinHostPort(host, fmt.Sprint(port)))
		if err == nil {
			require.NoError(t, l.Close())
			return host
		}
	}
	t.Fatalf("port %d is taken on every loopback address tried", port)
	return ""
}
