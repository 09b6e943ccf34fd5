// Package redistest runs real redis-server processes for tests: a primary
// with replicas on loopback ports, each with its own directory, stopped at
// the end of the test.
package redistest

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Node is one redis-server process.
type Node struct {
	Addr string
	Dir  string
	port int
	cmd  *exec.Cmd
	args []string
	t    testing.TB
}

// Group is a primary and its replicas.
type Group struct {
	Primary  *Node
	Replicas []*Node
}

// Binary returns the redis-server path, or skips the test with a clear
// message when it is not installed.
func Binary(t testing.TB) string {
	t.Helper()
	path, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("redis-server not installed: `make deps` installs the redis-server package")
	}
	return path
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// StartNode starts one redis-server with the given extra config directives
// ("key value" each).
func StartNode(t testing.TB, extra ...string) *Node {
	t.Helper()
	bin := Binary(t)
	n := &Node{t: t, port: freePort(t), Dir: t.TempDir()}
	n.Addr = "127.0.0.1:" + strconv.Itoa(n.port)
	n.args = []string{"--port", strconv.Itoa(n.port), "--bind", "127.0.0.1", "--dir", n.Dir,
		"--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--protected-mode", "no"}
	for _, e := range extra {
		k, v, _ := strings.Cut(e, " ")
		n.args = append(n.args, "--"+k)
		if v != "" {
			n.args = append(n.args, strings.Fields(v)...)
		}
	}
	n.start(bin)
	t.Cleanup(n.Kill)
	return n
}

func (n *Node) start(bin string) {
	n.t.Helper()
	n.cmd = exec.Command(bin, n.args...)
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	log, err := os.Create(filepath.Join(n.Dir, "redis.log"))
	if err != nil {
		n.t.Fatal(err)
	}
	n.cmd.Stdout, n.cmd.Stderr = log, log
	if err := n.cmd.Start(); err != nil {
		n.t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		c := redis.NewClient(&redis.Options{Addr: n.Addr, DialTimeout: 200 * time.Millisecond})
		err := c.Ping(context.Background()).Err()
		_ = c.Close()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(n.Dir, "redis.log"))
			n.t.Fatalf("redis-server on %s did not start: %v\n%s", n.Addr, err, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Kill stops the process with SIGKILL (a crash); safe to call twice.
func (n *Node) Kill() {
	if n.cmd == nil || n.cmd.Process == nil {
		return
	}
	_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
	_ = n.cmd.Wait()
	n.cmd = nil
}

// Restart starts the process again with its data directory.
func (n *Node) Restart() {
	n.t.Helper()
	n.Kill()
	n.start(Binary(n.t))
}

// Client returns a client to the node, closed at test end.
func (n *Node) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: n.Addr})
	n.t.Cleanup(func() { _ = c.Close() })
	return c
}

// StartGroup starts a primary with the given number of replicas, the
// primary refusing writes unless minReplicas replicas are connected and
// current (min-replicas-to-write / min-replicas-max-lag 2), and waits until
// every replica is in sync.
func StartGroup(t testing.TB, replicas, minReplicas int) *Group {
	t.Helper()
	g := &Group{Primary: StartNode(t, fmt.Sprintf("min-replicas-to-write %d", minReplicas), "min-replicas-max-lag 2")}
	for range replicas {
		host, port, _ := net.SplitHostPort(g.Primary.Addr)
		r := StartNode(t, "replicaof "+host+" "+port, fmt.Sprintf("min-replicas-to-write %d", minReplicas), "min-replicas-max-lag 2")
		g.Replicas = append(g.Replicas, r)
	}
	g.WaitSynced(30 * time.Second)
	return g
}

// WaitSynced waits until the primary reports every replica online and
// every replica has rewritten its AOF after the sync. Until that rewrite
// ends, a replica that restarts loads the data it had before the sync
// (Redis 7.0 keeps writes made meanwhile in a file its AOF manifest does
// not name yet), although it confirms writes (WAIT) from the start: a test
// that restarts a replica would see writes lost that Redis lost. Every
// few seconds without it, each replica is told its primary again: on a
// loaded machine a replica's first connection attempt can be lost, and the
// next one then waits for Redis's own retry.
func (g *Group) WaitSynced(timeout time.Duration) {
	c := redis.NewClient(&redis.Options{Addr: g.Primary.Addr})
	defer c.Close()
	host, port, _ := net.SplitHostPort(g.Primary.Addr)
	deadline := time.Now().Add(timeout)
	nudge := time.Now().Add(5 * time.Second)
	for {
		info, err := c.Info(context.Background(), "replication").Result()
		if err == nil && countOnline(info) >= len(g.Replicas) && g.aofRewritten() {
			return
		}
		if time.Now().After(deadline) {
			g.Primary.t.Fatalf("replicas not in sync after %v: %v\n%s", timeout, err, info)
		}
		if time.Now().After(nudge) {
			nudge = time.Now().Add(5 * time.Second)
			for _, r := range g.Replicas {
				rc := redis.NewClient(&redis.Options{Addr: r.Addr})
				_ = rc.Do(context.Background(), "REPLICAOF", host, port).Err()
				_ = rc.Close()
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// aofRewritten reports whether every replica has its link up, has loaded
// the sync, and is neither rewriting its AOF nor has a rewrite scheduled.
// The primary may report a replica online before the replica has read the
// end of a diskless sync; the rewrite starts in the same step that brings
// the replica's link up, so one INFO of both sections sees it.
func (g *Group) aofRewritten() bool {
	for _, r := range g.Replicas {
		c := redis.NewClient(&redis.Options{Addr: r.Addr})
		info, err := c.Info(context.Background(), "replication", "persistence").Result()
		_ = c.Close()
		if err != nil || !strings.Contains(info, "master_link_status:up") || !strings.Contains(info, "loading:0") ||
			strings.Contains(info, "aof_rewrite_in_progress:1") || strings.Contains(info, "aof_rewrite_scheduled:1") {
			return false
		}
	}
	return true
}

func countOnline(info string) int {
	n := 0
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "slave") && strings.Contains(line, "state=online") {
			n++
		}
	}
	return n
}

// CPU returns the CPU time (user + system) the group's servers have used,
// as each reports it (INFO cpu): benchmarks divide the difference by the
// records written to get Redis's cost per record, which the machine's
// load moves less than throughput.
func (g *Group) CPU() time.Duration {
	var total time.Duration
	for _, n := range append([]*Node{g.Primary}, g.Replicas...) {
		c := redis.NewClient(&redis.Options{Addr: n.Addr})
		info, err := c.Info(context.Background(), "cpu").Result()
		_ = c.Close()
		if err != nil {
			n.t.Fatalf("INFO cpu on %s: %v", n.Addr, err)
		}
		for _, line := range strings.Split(info, "\n") {
			k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
			if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
				s, err := strconv.ParseFloat(v, 64)
				if err != nil {
					n.t.Fatalf("INFO cpu on %s: %s: %v", n.Addr, line, err)
				}
				total += time.Duration(s * float64(time.Second))
			}
		}
	}
	return total
}

// CommandTime returns the time the node spent in cmd ("evalsha", ...) since
// it started, as INFO commandstats reports it: a benchmark's script time
// per record, apart from the replication and client work that CPU counts.
func (n *Node) CommandTime(cmd string) time.Duration {
	_, d := n.CommandStats(cmd)
	return d
}

// CommandStats returns how many times the node ran cmd since it started,
// and the time it spent in it (INFO commandstats).
func (n *Node) CommandStats(cmd string) (calls int64, spent time.Duration) {
	stats, ok := n.info("commandstats", "cmdstat_"+strings.ToLower(cmd))
	if !ok {
		return 0, 0
	}
	for _, f := range strings.Split(stats, ",") {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "calls":
			calls = n.parseInt(v)
		case "usec":
			spent = time.Duration(n.parseInt(v)) * time.Microsecond
		}
	}
	return calls, spent
}

// Forks returns how many times the group's servers forked since they
// started (INFO stats total_forks): AOF rewrites and full syncs, whose
// copy-on-write faults a benchmark running through them pays.
func (g *Group) Forks() int64 {
	var total int64
	for _, n := range append([]*Node{g.Primary}, g.Replicas...) {
		if v, ok := n.info("stats", "total_forks"); ok {
			total += n.parseInt(v)
		}
	}
	return total
}

// info returns the value of field in INFO section on the node.
func (n *Node) info(section, field string) (string, bool) {
	c := redis.NewClient(&redis.Options{Addr: n.Addr})
	info, err := c.Info(context.Background(), section).Result()
	_ = c.Close()
	if err != nil {
		n.t.Fatalf("INFO %s on %s: %v", section, n.Addr, err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v, true
		}
	}
	return "", false
}

func (n *Node) parseInt(v string) int64 {
	i, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		n.t.Fatalf("INFO on %s: %q: %v", n.Addr, v, err)
	}
	return i
}

// SetRate runs redis-benchmark's pipelined SET (-P 16, one key) against
// the node and returns its requests per second, or 0 when redis-benchmark
// is not installed: the reference a write benchmark's rate is a share of,
// taken just before it so that both see the same machine (its speed moves
// by 2x within minutes).
func (n *Node) SetRate(t testing.TB) float64 {
	out, err := exec.Command("redis-benchmark", "-h", "127.0.0.1", "-p", strconv.Itoa(n.port),
		"-P", "16", "-t", "set", "-n", "500000", "-q").CombinedOutput()
	if err != nil {
		t.Logf("redis-benchmark: %v", err)
		return 0
	}
	// The last report: "SET: 236630.39 requests per second, p50=...".
	text := string(out)
	i := strings.LastIndex(text, "SET: ")
	if i < 0 {
		return 0
	}
	f := strings.Fields(text[i+len("SET: "):])
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
