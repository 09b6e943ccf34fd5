package broker

import "time"

// rateLimiter is a token bucket owned by one connection's goroutine.
type rateLimiter struct {
	rate   float64 // tokens per second
	burst  float64
	tokens float64
	last   time.Time
}

func newRateLimiter(rate float64, burst int) *rateLimiter {
	return &rateLimiter{rate: rate, burst: float64(max(burst, 1)), tokens: float64(max(burst, 1))}
}

// take spends one token and returns how long to wait before going on.
func (r *rateLimiter) take(now time.Time) time.Duration {
	if !r.last.IsZero() {
		r.tokens = min(r.burst, r.tokens+now.Sub(r.last).Seconds()*r.rate)
	}
	r.last = now
	r.tokens--
	if r.tokens >= 0 {
		return 0
	}
	return time.Duration(-r.tokens / r.rate * float64(time.Second))
}
