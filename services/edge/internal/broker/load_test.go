package broker

import (
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"
)

// The load score is the larger of the connection share and the inbound
// message rate share of a fully loaded edge.
func TestBroker_LoadScore(t *testing.T) {
	t.Parallel()
	b, addr := startBroker(t, func(c *Config) { c.LoadConnections = 4; c.LoadMessageRate = 100 })
	require.Zero(t, b.loadScoreValue())
	c := mqtttest.Dial(t, addr, 5)
	c.Connect("a", true, packets.Properties{})
	require.InDelta(t, 0.25, b.loadScoreValue(), 1e-9, "one connection of four")

	before := b.inboundMessages()
	for i := range 30 {
		c.Publish(uint16(i+1), "t", 1, []byte("x"))
		c.Expect(packets.Puback)
	}
	require.Equal(t, 30.0, b.inboundMessages()-before)
	b.sampleLoad(b.inboundMessages()-before, 200*time.Millisecond) // 150 msgs/s
	require.InDelta(t, 1.5, b.loadScoreValue(), 1e-9, "over the message rate of a full edge")
}
