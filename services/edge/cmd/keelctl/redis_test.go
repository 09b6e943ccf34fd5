package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
)

// startRedis runs a redis-server on a free loopback port until the test
// ends; extra are "--name value" arguments.
func startRedis(t *testing.T, bin string, extra ...string) string {
	t.Helper()
	port := testutil.FreePort(t)
	dir := t.TempDir()
	args := append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir, "--save", "",
		"--appendonly", "no", "--protected-mode", "no", "--repl-diskless-sync-delay", "0",
		"--min-replicas-to-write", "1", "--min-replicas-max-lag", "2"}, extra...)
	cmd := exec.Command(bin, args...)
	log, err := os.Create(filepath.Join(dir, "redis.log"))
	require.NoError(t, err)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	testutil.Eventually(t, 10*time.Second, func() error { _, err := redisInfo(addr); return err })
	return addr
}

// redisInfo returns INFO replication of the node at addr as a map,
// speaking RESP by hand (the edge module has no Redis client).
func redisInfo(addr string) (map[string]string, error) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("*2\r\n$4\r\nINFO\r\n$11\r\nreplication\r\n")); err != nil {
		return nil, err
	}
	r := bufio.NewReader(c)
	head, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	if !strings.HasPrefix(head, "$") {
		return nil, fmt.Errorf("INFO: %q", head)
	}
	n, err := strconv.Atoi(strings.TrimSpace(head[1:]))
	if err != nil {
		return nil, err
	}
	body := make([]byte, n+2)
	if _, err := io.ReadFull(r, body); err != nil {
		return nil, err
	}
	info := map[string]string{}
	for line := range strings.Lines(string(body)) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			info[k] = v
		}
	}
	return info, nil
}

// replicaOf waits until the node at addr is a replica of primary with its
// link up.
func replicaOf(t *testing.T, addr, primary string) {
	t.Helper()
	host, port, _ := net.SplitHostPort(primary)
	testutil.Eventually(t, 15*time.Second, func() error {
		info, err := redisInfo(addr)
		if err != nil {
			return err
		}
		if info["role"] != "slave" || info["master_host"] != host || info["master_port"] != port || info["master_link_status"] != "up" {
			return fmt.Errorf("%s: role %s of %s:%s, link %s; want a replica of %s", addr, info["role"], info["master_host"],
				info["master_port"], info["master_link_status"], primary)
		}
		return nil
	})
}

// Against a real coordinator, persistence instance and Redis group (a
// primary and two replicas, processes): redis failover moves the primary to
// the replica with the highest offset, the coordinator's record (shown by
// cluster status) follows, and the old primary is a replica of the new one;
// with --to and -o json it moves back. Bad invocations fail with a clear
// error, and a bad target is refused by the service without any change.
func TestKeelctl_RedisFailover(t *testing.T) {
	redisBin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("redis-server not installed: `make deps` installs the redis-server package")
	}
	bins := buildServices(t, "coordinator", "persistence")
	primary := startRedis(t, redisBin)
	host, port, _ := net.SplitHostPort(primary)
	replicas := []string{startRedis(t, redisBin, "--replicaof", host, port), startRedis(t, redisBin, "--replicaof", host, port)}
	for _, r := range replicas {
		replicaOf(t, r, primary)
	}
	coordAPI, coordOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	persistAPI, persistOps := testutil.FreeAddr(t), testutil.FreeAddr(t)
	startService(t, "coordinator", bins["coordinator"], coordOps, "--api.addr", coordAPI, "--ops.addr", coordOps,
		"--raft.bind-addr", testutil.FreeAddr(t), "--gossip.bind-addr", testutil.FreeAddr(t), "--raft.bootstrap-expect", "1",
		"--raft.node-id", "c1", "--raft.data-dir", t.TempDir(), "--log.level", "warn")
	coordURL, persistURL := "http://"+coordAPI, "http://"+persistAPI
	startService(t, "persistence", bins["persistence"], persistOps, "--api.addr", persistAPI, "--ops.addr", persistOps,
		"--api.advertise-addr", persistURL, "--member-id", "p1", "--coordinator.addr", coordURL,
		"--redis.addr", primary, "--redis.replicas", strings.Join(replicas, ","),
		"--failover.check-interval", "100ms", "--failover.promotion-lease-ttl", "3s", "--log.level", "warn")
	ctx := t.Context()
	var out bytes.Buffer
	run1 := func(args ...string) (string, error) {
		out.Reset()
		err := run(ctx, args, &out, &out)
		return out.String(), err
	}
	table, err := run1("cluster", "status", "--coordinator", coordURL)
	require.NoError(t, err, table)
	require.Regexp(t, `(?m)^0\s+`+primary+`\s+\d+\s+`, table)

	// To the replica with the highest offset.
	start := time.Now()
	table, err = run1("redis", "failover", "--persistence", persistURL)
	require.NoError(t, err, table)
	t.Logf("redis failover (%v):\n%s", time.Since(start), table)
	require.Regexp(t, `^redis primary moved from `+primary+` to 127\.0\.0\.1:\d+; writes were paused for \S+\n`, table)
	require.Regexp(t, `(?m)^OLD PRIMARY\s+`+primary+` \(now a replica of the new primary\)$`, table)
	require.Regexp(t, `(?m)^RECORD EPOCH\s+\d+ \(was \d+\)$`, table)
	newPrimary := regexpFind(t, `(?m)^NEW PRIMARY\s+(\S+)$`, table)
	require.Contains(t, replicas, newPrimary)
	replicaOf(t, primary, newPrimary)
	status, err := run1("cluster", "status", "--coordinator", coordURL)
	require.NoError(t, err, status)
	require.Regexp(t, `(?m)^0\s+`+newPrimary+`\s+\d+\s+`, status, "the coordinator's record names the new primary")

	// Back to the first primary, named, as JSON.
	start = time.Now()
	js, err := run1("redis", "failover", "--persistence", persistURL, "--to", primary, "--timeout", "5s", "-o", "json")
	require.NoError(t, err, js)
	t.Logf("redis failover --to %s -o json (%v):\n%s", primary, time.Since(start), js)
	var sw struct {
		Switchover struct {
			OldPrimary        string   `json:"old_primary"`
			NewPrimary        string   `json:"new_primary"`
			RecordEpoch       string   `json:"record_epoch"`
			OldRecordEpoch    string   `json:"old_record_epoch"`
			PausedFor         string   `json:"paused_for"`
			Replicas          []string `json:"replica_addresses"`
			OldPrimaryDemoted bool     `json:"old_primary_demoted"`
		} `json:"switchover"`
	}
	require.NoError(t, json.Unmarshal([]byte(js), &sw))
	require.Equal(t, newPrimary, sw.Switchover.OldPrimary)
	require.Equal(t, primary, sw.Switchover.NewPrimary)
	require.True(t, sw.Switchover.OldPrimaryDemoted)
	require.ElementsMatch(t, replicas, sw.Switchover.Replicas)
	require.NotEmpty(t, sw.Switchover.PausedFor)
	epoch, _ := strconv.ParseUint(sw.Switchover.RecordEpoch, 10, 64)
	oldEpoch, _ := strconv.ParseUint(sw.Switchover.OldRecordEpoch, 10, 64)
	require.Greater(t, epoch, oldEpoch)
	replicaOf(t, newPrimary, primary)

	// The group as it stands: the primary, its two replicas with their
	// links up, the write marks of each.
	table, err = run1("redis", "status", "--persistence", persistURL)
	require.NoError(t, err, table)
	t.Logf("redis status:\n%s", table)
	require.Regexp(t, `^primary `+primary+`, record epoch \d+\n`, table)
	require.Regexp(t, `(?m)^`+primary+`\s+master\s+-\s+-\s+-\s+\d+/\d+\s+`, table)
	for _, r := range replicas {
		require.Regexp(t, `(?m)^`+r+`\s+slave\s+`+primary+`\s+up\s+\d+ B\s+\d+/\d+\s+`, table)
	}
	js, err = run1("redis", "status", "--persistence", persistURL, "-o", "json")
	require.NoError(t, err, js)
	var gs struct {
		Group struct {
			Primary string `json:"primary"`
			Nodes   []struct {
				Address string `json:"address"`
				Role    string `json:"role"`
			} `json:"nodes"`
		} `json:"group"`
	}
	require.NoError(t, json.Unmarshal([]byte(js), &gs))
	require.Equal(t, primary, gs.Group.Primary)
	require.Len(t, gs.Group.Nodes, 3)
	require.Equal(t, "master", gs.Group.Nodes[0].Role)
	table, err = run1("tenant", "usage", "--persistence", persistURL, "--tenant", "acme")
	require.NoError(t, err, table)
	require.Equal(t, "tenant acme over 1 Redis group(s)\nqueued   0\nbound    none\nretained 0\n", table)

	// Errors.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"redis", "failover"}, "give --persistence URL"},
		{[]string{"redis", "failover", "--persistence", persistURL, "--timeout", "2m"}, "at most 1m0s"},
		{[]string{"redis", "failover", "--persistence", persistURL, "extra"}, "takes no arguments"},
		{[]string{"redis", "failover", "--persistence", persistURL, "-o", "yaml"}, `-o "yaml"`},
		{[]string{"redis", "failover", "--persistence", persistURL, "--to", "127.0.0.1:1"}, "invalid_argument: bad switchover target: 127.0.0.1:1 is no node of the group"},
		{[]string{"redis", "failover", "--persistence", persistURL, "--to", primary}, "is already the primary"},
		{[]string{"redis", "failover", "--persistence", persistURL, "--to", "nohost"}, "invalid_argument"},
		{[]string{"redis", "bogus", "--persistence", persistURL}, "usage:"},
		{[]string{"redis", "status"}, "give --persistence URL"},
		{[]string{"redis", "status", "--persistence", persistURL + "," + persistURL}, "give one --persistence URL"},
		{[]string{"tenant", "usage", "--persistence", persistURL}, "give --tenant T"},
		{[]string{"tenant", "usage", "--persistence", persistURL, "--tenant", "Bad!"}, "invalid_argument"},
	} {
		msg, err := run1(tc.args...)
		require.Error(t, err, "%v: %s", tc.args, msg)
		require.Contains(t, err.Error(), tc.want, "%v", tc.args)
	}
	status, err = run1("cluster", "status", "--coordinator", coordURL)
	require.NoError(t, err, status)
	require.Regexp(t, `(?m)^0\s+`+primary+`\s+`+strconv.FormatUint(epoch, 10)+`\s+`, status, "refusals change nothing")
}

func regexpFind(t *testing.T, expr, s string) string {
	t.Helper()
	m := regexp.MustCompile(expr).FindStringSubmatch(s)
	require.Len(t, m, 2, "%s in %s", expr, s)
	return m[1]
}
