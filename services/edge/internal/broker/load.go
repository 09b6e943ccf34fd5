package broker

import (
	"context"
	"math"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// loadInterval is how often the inbound message rate of the load score is
// sampled.
const loadInterval = 5 * time.Second

// loadScore is keel_edge_load_score: how loaded this edge is, 1 being the
// configured full load. It is the larger of connections over
// --mqtt.load-connections and inbound messages per second over
// --mqtt.load-message-rate, so an autoscaler adds edges for many idle
// devices as well as for a few busy ones (CPU covers the rest).
type loadScore struct {
	rate atomic.Uint64 // float64 bits: inbound messages per second, last interval
}

func (b *Broker) loadScoreValue() float64 {
	conns := float64(atomic.LoadInt64(&b.server.Info.ClientsConnected)) / float64(b.cfg.LoadConnections)
	rate := math.Float64frombits(b.load.rate.Load()) / b.cfg.LoadMessageRate
	return max(conns, rate)
}

// inboundMessages reads the inbound message counters (every QoS).
func (b *Broker) inboundMessages() float64 {
	var n float64
	for _, c := range b.mIn {
		var m dto.Metric
		if c.Write(&m) == nil {
			n += m.GetCounter().GetValue()
		}
	}
	return n
}

// RunLoad samples the inbound message rate for the load score until ctx
// ends.
func (b *Broker) RunLoad(ctx context.Context) {
	t := time.NewTicker(loadInterval)
	defer t.Stop()
	last, at := b.inboundMessages(), time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-b.done:
			return
		case now := <-t.C:
			n := b.inboundMessages()
			b.sampleLoad(n-last, now.Sub(at))
			last, at = n, now
		}
	}
}

func (b *Broker) sampleLoad(messages float64, over time.Duration) {
	if over <= 0 {
		return
	}
	b.load.rate.Store(math.Float64bits(messages / over.Seconds()))
}
