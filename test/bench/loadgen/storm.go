package loadgen

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/keelmq/keel/test/bench/wire"
)

// runStorm connects cfg.Clients clients as fast as ConnectConcurrency
// allows, holds them for cfg.Hold, samples the broker, and disconnects them.
// Storm reports connects/s; idle reports resident memory per client.
func runStorm(ctx context.Context, cfg *Config, runID uint32) (*Result, error) {
	smp := newSampler(cfg)
	clients := make([]*client, cfg.Clients)
	hists := make([]Histogram, cfg.ConnectConcurrency)
	var failed atomic.Uint64
	var firstErr error
	var errOnce sync.Once
	var worker atomic.Int64

	before := smp.take()
	// Workers pick the next index; each keeps its own histogram.
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(cfg.Clients, cfg.ConnectConcurrency) {
		wg.Go(func() {
			h := &hists[worker.Add(1)-1]
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= cfg.Clients {
					return
				}
				t0 := time.Now()
				c, err := dial(ctx, cfg, cfg.PubAddr, fmt.Sprintf("kb%08x-c%d", runID, i), smallReadBuf)
				if err != nil {
					failed.Add(1)
					errOnce.Do(func() { firstErr = err })
					continue
				}
				h.Record(time.Since(t0))
				clients[i] = c
			}
		})
	}
	wg.Wait()
	connected := smp.take()
	if err := ctx.Err(); err != nil {
		closeClients(clients)
		return nil, err
	}

	if cfg.Ping && cfg.Scenario == ScenarioIdle {
		if err := pingAll(ctx, clients); err != nil {
			closeClients(clients)
			return nil, err
		}
	}
	var held sample
	if cfg.Hold > 0 {
		sleepUntil(ctx, time.Now().Add(cfg.Hold))
		held = smp.take()
	} else {
		held = connected
	}

	t0 := time.Now()
	closeClients(clients)
	disconnect := time.Since(t0)

	var h Histogram
	for i := range hists {
		h.Merge(&hists[i])
	}
	win := connected.at.Sub(before.at)
	r := &Result{
		Broker: cfg.Broker, Label: cfg.Label, Scenario: cfg.Scenario, Clients: cfg.Clients,
		Size: cfg.Size, QoS: cfg.QoS,
		Seconds: win.Seconds(), Unit: "connects/s",
		ConnectErrors: failed.Load(), DisconnectSec: disconnect.Seconds(),
		P50us: us(h.Quantile(0.5)), P90us: us(h.Quantile(0.9)), P99us: us(h.Quantile(0.99)), MaxUs: us(h.Max()),
		GenCores: (connected.self - before.self).Seconds() / win.Seconds(), OtherCores: otherCores(before, connected),
	}
	ok := h.Count()
	if cfg.Scenario == ScenarioStorm {
		r.Rate = float64(ok) / win.Seconds()
	} else {
		r.Unit = "B/client"
	}
	if firstErr != nil {
		r.Errors = int(failed.Load())
		r.FirstError = firstErr.Error()
	}
	if cfg.BrokerPID > 0 {
		cpu := connected.broker.cpu - before.broker.cpu
		r.BrokerCPUSec = cpu.Seconds()
		r.BrokerCores = cpu.Seconds() / win.Seconds()
		if ok > 0 {
			r.BrokerCPUusPer = us(cpu) / float64(ok)
			r.RSSPerClient = float64(held.broker.rss-before.broker.rss) / float64(ok)
		}
		r.BrokerRSS = held.broker.rss
		r.BrokerPeakRSS = held.broker.hwm
		if cfg.Scenario == ScenarioIdle {
			r.Rate = r.RSSPerClient
		}
	}
	if smp.err != nil {
		r.BrokerSampleErr = smp.err.Error()
	}
	return r, nil
}

// pingAll has every open client send a PINGREQ and read its PINGRESP.
func pingAll(ctx context.Context, clients []*client) error {
	return forEach(ctx, len(clients), 64, func(_ context.Context, i int) error {
		c := clients[i]
		if c == nil {
			return nil
		}
		_ = c.conn.SetDeadline(time.Now().Add(handshakeTimeout))
		defer func() { _ = c.conn.SetDeadline(time.Time{}) }()
		if _, err := c.conn.Write(wire.AppendPingreq(nil)); err != nil {
			return fmt.Errorf("send pingreq: %w", err)
		}
		h, _, err := c.r.Next()
		if err != nil {
			return fmt.Errorf("read pingresp: %w", err)
		}
		if h>>4 != wire.Pingresp {
			return fmt.Errorf("read pingresp: got packet type %d", h>>4)
		}
		return nil
	})
}

// closeClients disconnects every open client, a few at a time in parallel.
func closeClients(clients []*client) {
	_ = forEach(context.Background(), len(clients), 16, func(_ context.Context, i int) error {
		if c := clients[i]; c != nil {
			c.disconnect()
		}
		return nil
	})
}
