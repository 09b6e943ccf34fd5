package discovery

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/testutil"
)

func TestConfig_Validate(t *testing.T) {
	require.NoError(t, (&Config{BindAddr: ":7946", JoinInterval: time.Second}).Validate())
	require.Error(t, (&Config{BindAddr: "7946", JoinInterval: time.Second}).Validate())
	require.Error(t, (&Config{BindAddr: ":7946"}).Validate())
}

func TestNew_Refuses(t *testing.T) {
	cfg := Config{BindAddr: ":0", JoinInterval: time.Second}
	_, err := New(cfg, Meta{Role: RoleCoordinator}, nil)
	require.Error(t, err, "no id")
	_, err = New(cfg, Meta{ID: "x"}, nil)
	require.Error(t, err, "no role")
	_, err = New(cfg, Meta{ID: "x", Role: "edge", APIAddr: strings.Repeat("a", 600)}, nil)
	require.Error(t, err, "metadata larger than memberlist allows")
}

func start(t *testing.T, meta Meta, join ...string) *Discovery {
	t.Helper()
	d, err := New(Config{BindAddr: testutil.FreeAddr(t), Join: config.StringList(join), JoinInterval: 50 * time.Millisecond, Local: true},
		meta, testutil.Logger(t).With("member", meta.ID))
	require.NoError(t, err)
	require.NoError(t, d.Start())
	t.Cleanup(func() { _ = d.Stop(time.Second) })
	return d
}

func ids(ms []Member) string {
	var out []string
	for _, m := range ms {
		out = append(out, m.Meta.ID)
	}
	return strings.Join(out, ",")
}

// TestDiscovery_JoinMetaLeave: members find each other through a join address
// that answers only later (retried), see each other's metadata, filter
// coordinators by role, are notified of changes, and see a graceful leave.
func TestDiscovery_JoinMetaLeave(t *testing.T) {
	a := start(t, Meta{Role: RoleCoordinator, ID: "c1", RaftAddr: "10.0.0.1:7400", APIAddr: "10.0.0.1:7401"})
	host, port, err := net.SplitHostPort(a.Addr())
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1", host)
	_, err = strconv.Atoi(port)
	require.NoError(t, err)

	// c2 joins a dead address first and a's address (as a name) too: the
	// join succeeds once any address answers.
	dead := testutil.FreeAddr(t)
	b := start(t, Meta{Role: RoleCoordinator, ID: "c2", RaftAddr: "10.0.0.2:7400", APIAddr: "10.0.0.2:7401"}, dead, "localhost:"+port)
	e := start(t, Meta{Role: "edge", ID: "edge-1", APIAddr: "10.0.0.9:1883"}, a.Addr())

	for _, d := range []*Discovery{a, b, e} {
		testutil.Eventually(t, 10*time.Second, func() error {
			if got := ids(d.Members()); got != "c1,c2,edge-1" {
				return fmt.Errorf("%s sees %s", d.self.ID, got)
			}
			return nil
		})
	}
	require.Equal(t, "c1,c2", ids(e.Coordinators()))
	cs := e.Coordinators()
	require.Equal(t, Meta{Role: RoleCoordinator, ID: "c1", RaftAddr: "10.0.0.1:7400", APIAddr: "10.0.0.1:7401"}, cs[0].Meta)
	require.Equal(t, "c1", cs[0].Name)

	select {
	case <-a.Changed():
	case <-time.After(5 * time.Second):
		t.Fatal("no change notification")
	}

	require.NoError(t, b.Stop(time.Second))
	require.NoError(t, b.Stop(time.Second), "stop twice")
	testutil.Eventually(t, 10*time.Second, func() error {
		if got := ids(a.Coordinators()); got != "c1" {
			return errors.New("a still sees " + got)
		}
		return nil
	})
}

// TestDiscovery_JoinRetries: a member whose join address is not up yet keeps
// trying and joins once it is.
func TestDiscovery_JoinRetries(t *testing.T) {
	addr := testutil.FreeAddr(t)
	b := start(t, Meta{Role: RoleCoordinator, ID: "c2"}, addr)
	time.Sleep(150 * time.Millisecond) // a few failed attempts
	a, err := New(Config{BindAddr: addr, JoinInterval: time.Second, Local: true}, Meta{Role: RoleCoordinator, ID: "c1"}, testutil.Logger(t))
	require.NoError(t, err)
	require.NoError(t, a.Start())
	t.Cleanup(func() { _ = a.Stop(time.Second) })
	testutil.Eventually(t, 10*time.Second, func() error {
		if got := ids(b.Coordinators()); got != "c1,c2" {
			return errors.New("b sees " + got)
		}
		return nil
	})
}

// TestStop_NotStarted: stopping a discovery that never started is a no-op.
func TestStop_NotStarted(t *testing.T) {
	d, err := New(Config{BindAddr: ":0", JoinInterval: time.Second}, Meta{Role: RoleCoordinator, ID: "c1"}, nil)
	require.NoError(t, err)
	require.NoError(t, d.Stop(time.Second))
}
