package redisstore

import (
	"bufio"
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrFull refuses a write that would grow the group's data (an append, a
// retained message) while the primary's memory is above its high-water
// mark: under maxmemory with noeviction, Redis would refuse writes at the
// limit, including the deletes that free memory (Lua scripts that touch a
// key refuse at OOM), and the group would wedge. Below the mark there is
// room for sends, completes and deletes to drain it. The write is not
// acknowledged; the edge holds the publisher back and sends again.
var ErrFull = errors.New("redis memory above its high-water mark")

// MemoryObserver hears the primary's memory after each check (used and
// maxmemory in bytes, 0 for no limit) and whether it is above the mark.
type MemoryObserver func(used, limit int64, full bool)

// DefaultHighWater is the share of maxmemory above which appends stop.
const DefaultHighWater = 0.9

// watchMemory reads the primary's INFO memory every interval and sets
// s.full while used_memory is at or above the mark. A primary without
// maxmemory has no mark (logged once).
//
// It has a client of its own: go-redis v9.23 races when two goroutines
// open the first connections of one client at once (initConn, seen under
// -race beside the committer's first connection).
func (s *Store) watchMemory(every time.Duration) {
	defer s.wg.Done()
	rdb := redis.NewClient(&redis.Options{Addr: s.cfg.Addr, PoolSize: 1, Dialer: s.cfg.Dialer})
	defer rdb.Close()
	t := time.NewTicker(every)
	defer t.Stop()
	warned := false
	for {
		ctx, cancel := context.WithTimeout(context.Background(), every)
		info, err := rdb.Info(ctx, "memory").Result()
		cancel()
		if err == nil {
			used, limit := parseMemory(info)
			full := limit > 0 && float64(used) >= s.cfg.HighWater*float64(limit)
			if s.full.Swap(full) != full {
				if full {
					s.logger.Warn("redis memory above its high-water mark; appends refused until it drains",
						"used_bytes", used, "maxmemory", limit, "high_water", s.cfg.HighWater)
				} else {
					s.logger.Info("redis memory below its high-water mark again; appends taken", "used_bytes", used, "maxmemory", limit)
				}
			}
			if limit == 0 && !warned {
				warned = true
				s.logger.Warn("redis has no maxmemory: no high-water mark guards it (set maxmemory with maxmemory-policy noeviction)")
			}
			if s.cfg.MemoryObserver != nil {
				s.cfg.MemoryObserver(used, limit, full)
			}
		}
		select {
		case <-s.done:
			return
		case <-t.C:
		}
	}
}

// parseMemory reads used_memory and maxmemory from INFO memory.
func parseMemory(info string) (used, limit int64) {
	EachInfoField(info, func(k, v string) {
		switch k {
		case "used_memory":
			used, _ = strconv.ParseInt(v, 10, 64)
		case "maxmemory":
			limit, _ = strconv.ParseInt(v, 10, 64)
		}
	})
	return used, limit
}

// EachInfoField calls fn with each "key:value" line of an INFO answer, in
// order (section headers and blank lines skipped).
func EachInfoField(info string, fn func(key, value string)) {
	sc := bufio.NewScanner(strings.NewReader(info))
	for sc.Scan() {
		if k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":"); ok {
			fn(k, v)
		}
	}
}

// Full reports whether appends are refused for memory now.
func (s *Store) Full() bool { return s.full.Load() }
