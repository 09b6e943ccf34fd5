package remotestore

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/keelmq/keel/libs/testutil"
)

// persistenceBin is keel-persistence, built once by TestMain.
var persistenceBin string

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "remotestore-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "temp dir:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	root, err := testutil.RepoRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	persistenceBin = filepath.Join(dir, "keel-persistence")
	cmd := exec.Command("go", "build", "-o", persistenceBin, "./services/persistence/cmd/keel-persistence")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build keel-persistence: %v\n%s", err, out)
		return 1
	}
	return m.Run()
}

var (
	portsMu sync.Mutex
	ports   = map[int]bool{}
)

// freePort returns a port of 21000-21999 that was free on loopback when
// chosen, never the same twice in one test binary (the range stays below
// the kernel's ephemeral ports, which outgoing connections take).
func freePort(t testing.TB) int {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	start := 21000 + rand.IntN(1000)
	for i := range 1000 {
		p := 21000 + (start-21000+i)%1000
		if ports[p] {
			continue
		}
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			continue
		}
		_ = ln.Close()
		ports[p] = true
		return p
	}
	t.Fatal("no free port in 21000-21999")
	return 0
}

func freeAddr(t testing.TB) string { return "127.0.0.1:" + strconv.Itoa(freePort(t)) }

// proc is a service process of a test: started, killed and started again
// with the same arguments (ports and data directory).
type proc struct {
	t     testing.TB
	name  string
	bin   string
	args  []string
	ready func() error

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	logs *syncBuffer
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

func startProc(t testing.TB, name, bin string, ready func() error, args ...string) *proc {
	t.Helper()
	p := &proc{t: t, name: name, bin: bin, args: args, ready: ready, logs: &syncBuffer{}}
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("%s logs:\n%s", name, p.logs.String())
		}
	})
	p.start()
	return p
}

// start runs the process and waits until it is ready.
func (p *proc) start() {
	p.t.Helper()
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = p.logs, p.logs
	if err := cmd.Start(); err != nil {
		p.t.Fatalf("start %s: %v", p.name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	testutil.Eventually(p.t, 30*time.Second, func() error {
		select {
		case <-done:
			return fmt.Errorf("%s exited: %s", p.name, p.logs.String())
		default:
		}
		return p.ready()
	})
}

// kill ends the process at once (SIGKILL), as a crash would.
func (p *proc) kill() { p.signal(syscall.SIGKILL) }

// stop ends the process gracefully (SIGTERM), killing it after 20 s.
func (p *proc) stop() { p.signal(syscall.SIGTERM) }

func (p *proc) signal(sig syscall.Signal) {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.cmd = nil
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		p.t.Logf("%s did not stop within 20s of %v; killed", p.name, sig)
		_ = cmd.Process.Kill()
		<-done
	}
}

// persistence is a running keel-persistence.
type persistence struct {
	*proc
	URL string
}

// startPersistence runs keel-persistence on loopback: on the embedded store
// in a directory of its own when redisAddr is empty, or else in front of
// that Redis, unreplicated.
func startPersistence(t testing.TB, redisAddr string) *persistence {
	t.Helper()
	api, ops := freeAddr(t), freeAddr(t)
	args := []string{"--api.addr", api, "--ops.addr", ops, "--log.level", "warn", "--member-id", "test"}
	if redisAddr == "" {
		args = append(args, "--data-dir", t.TempDir())
	} else {
		args = append(args, "--redis.addr", redisAddr, "--redis.min-replicas", "0", "--unreplicated")
	}
	ready := func() error {
		resp, err := http.Get("http://" + ops + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("readyz %d", resp.StatusCode)
		}
		return nil
	}
	return &persistence{proc: startProc(t, "keel-persistence", persistenceBin, ready, args...), URL: "http://" + api}
}

// startRedis runs a redis-server that keeps nothing on disk, skipping the
// test when none is installed.
func startRedis(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("redis-server not installed (apt-get install redis-server)")
	}
	port := freePort(t)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	ready := func() error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(time.Second))
		if _, err := c.Write([]byte("PING\r\n")); err != nil {
			return err
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			return err
		}
		if !strings.HasPrefix(line, "+PONG") {
			return fmt.Errorf("redis answered %q", line)
		}
		return nil
	}
	startProc(t, "redis-server", bin, ready, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", t.TempDir(),
		"--save", "", "--appendonly", "no", "--protected-mode", "no")
	return addr
}

// backend starts a persistence service of one kind.
type backend struct {
	name  string
	start func(t testing.TB) *persistence
}

var backends = []backend{
	{"embedded", func(t testing.TB) *persistence { return startPersistence(t, "") }},
	{"redis", func(t testing.TB) *persistence { return startPersistence(t, startRedis(t)) }},
}
