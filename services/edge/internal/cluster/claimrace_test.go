package cluster

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// TestCluster_OneConnectionPerClientID: the same client ID connecting to
// two edges at the same moment ends with at most one live connection
// (DESIGN invariant 3), whichever edge's claim came second.
func TestCluster_OneConnectionPerClientID(t *testing.T) {
	if testing.Short() {
		t.Skip("starts several processes; skipped under -short")
	}
	t.Parallel()
	c := startSharedCluster(t, "edge-a", "edge-b")
	a, b := c.edges["edge-a"], c.edges["edge-b"]

	const pairs = 30
	type conn struct {
		c     *mqtttest.Client
		acked bool
	}
	conns := make([][2]conn, pairs)
	var wg sync.WaitGroup
	for i := range pairs {
		for k, addr := range []string{a.mqtt, b.mqtt} {
			wg.Go(func() {
				cl := mqtttest.Dial(t, addr, 5)
				cl.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect},
					Connect:    packets.ConnectParams{ProtocolName: []byte("MQTT"), Clean: i%2 == 0, Keepalive: 30, ClientIdentifier: fmt.Sprintf("twin-%d", i)},
					Properties: packets.Properties{SessionExpiryInterval: uint32(i%2) * 300, SessionExpiryIntervalFlag: i%2 == 1}})
				pk, err := cl.Read(10 * time.Second)
				conns[i][k] = conn{c: cl, acked: err == nil && pk.FixedHeader.Type == packets.Connack && pk.ReasonCode == packets.CodeSuccess.Code}
			})
		}
	}
	wg.Wait()
	time.Sleep(2 * time.Second) // whatever loses is closed by now
	for i, pair := range conns {
		live := 0
		for _, cn := range pair {
			if !cn.acked {
				continue
			}
			// A live connection answers a PINGREQ; a closed one reads a
			// DISCONNECT or the end of the stream.
			cn.c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pingreq}})
			for {
				pk, err := cn.c.Read(2 * time.Second)
				if err != nil {
					require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "twin-%d: a connection neither answers nor closes", i)
					break
				}
				if pk.FixedHeader.Type == packets.Pingresp {
					live++
					break
				}
				if pk.FixedHeader.Type == packets.Disconnect {
					break
				}
			}
		}
		require.LessOrEqual(t, live, 1, "twin-%d: %d live connections", i, live)
	}
}
