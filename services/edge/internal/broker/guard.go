package broker

import (
	"net"
	"sync"
	"time"
)

// guard bounds authentication abuse: addresses that fail too often within
// a window are banned for a while, and each listener admits at most a given
// rate of new connections.
//
// Bans are by IP address, not by user name: anyone can send a CONNECT
// naming any user, so a ban of the name would let one address lock a
// device out of every edge with a few wrong passwords (the name carries
// no tenant either, so it would lock out that name in every tenant).
type guard struct {
	maxFailures int
	window      time.Duration
	banFor      time.Duration

	mu    sync.Mutex
	fails map[string]*failures // IP address
	bans  map[string]time.Time // IP address -> end of ban

	connRate  float64
	connBurst int
	buckets   map[string]*rateLimiter // listener ID -> bucket
}

type failures struct {
	count int
	start time.Time
}

func newGuard(cfg *Config) *guard {
	return &guard{
		maxFailures: cfg.AuthMaxFailures, window: cfg.AuthFailureWindow, banFor: cfg.AuthBanDuration,
		fails: map[string]*failures{}, bans: map[string]time.Time{},
		connRate: cfg.ConnectRate, connBurst: cfg.ConnectBurst, buckets: map[string]*rateLimiter{},
	}
}

func ipOf(remote string) string {
	if host, _, err := net.SplitHostPort(remote); err == nil {
		return host
	}
	return remote
}

// banned reports whether the remote address is banned now.
func (g *guard) banned(remote string, now time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.bans) == 0 {
		return false // the usual case, without building the key
	}
	k := ipOf(remote)
	if until, ok := g.bans[k]; ok {
		if now.Before(until) {
			return true
		}
		delete(g.bans, k)
	}
	return false
}

// failed records an authentication failure from remote and reports
// whether it led to a ban.
func (g *guard) failed(remote string, now time.Time) bool {
	if g.maxFailures <= 0 {
		return false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	k := ipOf(remote)
	f := g.fails[k]
	if f == nil || now.Sub(f.start) > g.window {
		f = &failures{start: now}
		g.fails[k] = f
	}
	f.count++
	bannedNow := false
	if f.count >= g.maxFailures {
		g.bans[k] = now.Add(g.banFor)
		delete(g.fails, k)
		bannedNow = true
	}
	if len(g.fails) > 100_000 {
		g.sweepLocked(now)
	}
	return bannedNow
}

func (g *guard) sweepLocked(now time.Time) {
	for k, f := range g.fails {
		if now.Sub(f.start) > g.window {
			delete(g.fails, k)
		}
	}
	for k, until := range g.bans {
		if now.After(until) {
			delete(g.bans, k)
		}
	}
}

// admit takes a token from the listener's connection bucket.
func (g *guard) admit(listener string, now time.Time) bool {
	if g.connRate <= 0 {
		return true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	b := g.buckets[listener]
	if b == nil {
		b = newRateLimiter(g.connRate, g.connBurst)
		g.buckets[listener] = b
	}
	if b.take(now) > 0 {
		b.tokens++ // refused: give the token back
		return false
	}
	return true
}
