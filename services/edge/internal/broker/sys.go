package broker

import (
	"context"
	"strconv"
	"time"
)

// Version is reported on $SYS/broker/version.
var Version = "dev"

// RunSys publishes each tenant's $SYS topics every interval until ctx ends.
// Each tenant sees only its own figures: $SYS topics live in the tenant's
// namespace like any other topic.
func (b *Broker) RunSys(ctx context.Context, interval time.Duration) {
	if interval <= 0 {
		return
	}
	started := time.Now()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		b.publishSys(started)
		select {
		case <-ctx.Done():
			return
		case <-b.done:
			return
		case <-t.C:
		}
	}
}

type tenantStats struct {
	connected, sessions, subscriptions int
}

func (b *Broker) publishSys(started time.Time) {
	stats := map[string]*tenantStats{}
	get := func(tenant string) *tenantStats {
		st := stats[tenant]
		if st == nil {
			st = &tenantStats{}
			stats[tenant] = st
		}
		return st
	}
	b.sessMu.Lock()
	for _, s := range b.sessions {
		st := get(s.scope.Tenant())
		st.sessions++
		if s.online.Load() {
			st.connected++
		}
		s.mu.Lock()
		st.subscriptions += len(s.subs)
		s.mu.Unlock()
	}
	b.sessMu.Unlock()
	uptime := []byte(strconv.FormatInt(int64(time.Since(started).Seconds()), 10))
	for tenant, st := range stats {
		for _, kv := range []struct {
			topic string
			value []byte
		}{
			{"$SYS/broker/version", []byte(Version)},
			{"$SYS/broker/uptime", uptime},
			{"$SYS/broker/clients/connected", []byte(strconv.Itoa(st.connected))},
			{"$SYS/broker/sessions", []byte(strconv.Itoa(st.sessions))},
			{"$SYS/broker/subscriptions", []byte(strconv.Itoa(st.subscriptions))},
		} {
			if err := b.Publish(tenant, kv.topic, kv.value, 0, true); err != nil {
				b.logger.Debug("sys publish failed", "tenant", tenant, "error", err)
			}
		}
	}
}
