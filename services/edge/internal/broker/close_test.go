package broker

import (
	"fmt"
	"net"
	"os"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/edge/internal/listener"
)

// connectPacket is an MQTT 3.1.1 CONNECT with clean session for id.
func connectPacket(id string) []byte {
	body := append([]byte{0, 4, 'M', 'Q', 'T', 'T', 4, 0x02, 0, 60, 0, byte(len(id))}, id...)
	return append([]byte{0x10, byte(len(body))}, body...)
}

// The edge stops while clients keep connecting: no stop may hang. mochi's
// own Server.Close can, when a client registers while it lists the
// clients of a listener (closeListeners).
func TestBroker_CloseDuringConnectStorm(t *testing.T) {
	if testing.Short() {
		t.Skip("a storm of connections; skipped under -short")
	}
	t.Parallel()
	for round := range 20 {
		cfg := DefaultConfig()
		cfg.EdgeID = "test"
		b, err := New(cfg, anonymous(), testutil.Logger(t), prometheus.NewRegistry())
		require.NoError(t, err)
		l := listener.NewTCP("tcp", "127.0.0.1:0", nil)
		require.NoError(t, b.AddListener(l))
		require.NoError(t, b.Serve())
		addr := l.Address()

		var stop atomic.Bool
		var wg sync.WaitGroup
		var connected atomic.Int64
		for w := range 8 {
			wg.Go(func() {
				var conns []net.Conn
				defer func() {
					for _, c := range conns {
						_ = c.Close()
					}
				}()
				for i := 0; !stop.Load(); i++ {
					c, err := net.DialTimeout("tcp", addr, time.Second)
					if err != nil {
						continue
					}
					conns = append(conns, c)
					_ = c.SetDeadline(time.Now().Add(time.Second))
					if _, err := c.Write(connectPacket(fmt.Sprintf("r%d-w%d-%d", round, w, i))); err == nil {
						connected.Add(1)
					}
				}
			})
		}
		require.Eventually(t, func() bool { return connected.Load() > 200 }, 10*time.Second, time.Millisecond)
		closed := make(chan struct{})
		go func() { _ = b.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(15 * time.Second):
			_ = pprof.Lookup("goroutine").WriteTo(os.Stderr, 1)
			t.Fatalf("round %d: Close hung with clients connecting", round)
		}
		stop.Store(true)
		wg.Wait()
	}
}
