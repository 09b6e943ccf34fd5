package broker

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/auth"
	"github.com/keelmq/keel/services/edge/internal/listener"
)

// startBroker runs a broker with anonymous access on a loopback port.
func startBroker(t *testing.T, mutate func(*Config)) (*Broker, string) {
	t.Helper()
	return startBrokerPrepared(t, mutate, nil)
}

// startBrokerPrepared is startBroker; prepare, when set, is given the
// broker before it serves.
func startBrokerPrepared(t *testing.T, mutate func(*Config), prepare func(*Broker)) (*Broker, string) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.EdgeID = "test"
	if mutate != nil {
		mutate(&cfg)
	}
	b, err := New(cfg, auth.Anonymous{Tenant: "default"}, testutil.Logger(t), prometheus.NewRegistry())
	require.NoError(t, err)
	if prepare != nil {
		prepare(b)
	}
	l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
	require.NoError(t, b.AddListener(l))
	require.NoError(t, b.Serve())
	t.Cleanup(func() { _ = b.Close() })
	return b, l.Address()
}

func anonymous() auth.Authenticator { return auth.Anonymous{Tenant: "default"} }

func newTCP(addr string) *listener.TCP {
	return listener.NewTCP("tcp", addr, nil)
}
