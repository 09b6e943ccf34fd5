package loadgen

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTick is USER_HZ, the unit of utime/stime in /proc/<pid>/stat. It is
// 100 on every Linux architecture Go supports.
const clockTick = 10 * time.Millisecond

// procSample is a point-in-time reading of a process.
type procSample struct {
	cpu time.Duration // utime + stime
	rss int64         // bytes
	hwm int64         // peak resident bytes
}

// splitPIDs parses a comma-separated list of pids.
func splitPIDs(v string) ([]int, error) {
	var pids []int
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		pid, err := strconv.Atoi(f)
		if err != nil || pid <= 0 {
			return nil, fmt.Errorf("not a pid: %q", f)
		}
		pids = append(pids, pid)
	}
	return pids, nil
}

// readProc reads /proc/<pid>/stat and /proc/<pid>/status.
func readProc(pid int) (procSample, error) {
	var s procSample
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return s, fmt.Errorf("read broker stat: %w", err)
	}
	// The command name may contain spaces and parentheses: fields start
	// after the last ')'. Field 3 (state) is then index 0, so utime (field
	// 14) and stime (field 15) are indexes 11 and 12.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return s, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	f := bytes.Fields(stat[i+1:])
	if len(f) < 13 {
		return s, fmt.Errorf("parse /proc/%d/stat: %d fields", pid, len(f))
	}
	ut, err1 := strconv.ParseInt(string(f[11]), 10, 64)
	st, err2 := strconv.ParseInt(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return s, fmt.Errorf("parse /proc/%d/stat times", pid)
	}
	s.cpu = time.Duration(ut+st) * clockTick

	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return s, fmt.Errorf("read broker status: %w", err)
	}
	for line := range bytes.Lines(status) {
		switch {
		case bytes.HasPrefix(line, []byte("VmRSS:")):
			s.rss = parseKB(line)
		case bytes.HasPrefix(line, []byte("VmHWM:")):
			s.hwm = parseKB(line)
		}
	}
	return s, nil
}

func parseKB(line []byte) int64 {
	f := bytes.Fields(line)
	if len(f) < 2 {
		return 0
	}
	n, _ := strconv.ParseInt(string(f[1]), 10, 64)
	return n * 1024
}

// selfCPU returns this process's user+system CPU time.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// systemBusy returns the CPU time all processes on the machine have used
// (every /proc/stat "cpu" column except idle and iowait).
func systemBusy() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := bytes.Fields(line)
	if len(f) < 5 || string(f[0]) != "cpu" {
		return 0
	}
	var busy int64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		n, _ := strconv.ParseInt(string(v), 10, 64)
		busy += n
	}
	return time.Duration(busy) * clockTick
}

// WaitQuiet waits until the machine's CPU use, sampled over 500 ms, is below
// maxCores, or until timeout. It returns the last measured use in cores.
// Benchmarks on a shared machine use it to avoid measuring someone else's
// load; the run still reports what else ran in [Result.OtherCores].
func WaitQuiet(ctx context.Context, maxCores float64, timeout time.Duration) float64 {
	deadline := time.Now().Add(timeout)
	for {
		b0, t0 := systemBusy(), time.Now()
		sleepUntil(ctx, t0.Add(500*time.Millisecond))
		cores := (systemBusy() - b0).Seconds() / time.Since(t0).Seconds()
		if cores < maxCores || time.Now().After(deadline) || ctx.Err() != nil {
			return cores
		}
	}
}

// sampler takes broker and self readings; with no pid it samples only self.
// A broker of several processes is read as their sum, and each one's CPU
// is kept beside it.
type sampler struct {
	pids []int // the broker's processes, -broker-pid first
	err  error
}

func newSampler(cfg *Config) sampler {
	if cfg.BrokerPID <= 0 {
		return sampler{}
	}
	return sampler{pids: append([]int{cfg.BrokerPID}, cfg.BrokerPIDs...)}
}

type sample struct {
	at     time.Time
	self   time.Duration
	system time.Duration
	broker procSample
	// cpu of each broker process, in the sampler's order (set for a broker
	// of several processes).
	each []time.Duration
}

func (s *sampler) take() sample {
	out := sample{at: time.Now(), self: selfCPU(), system: systemBusy()}
	for _, pid := range s.pids {
		b, err := readProc(pid)
		if err != nil && s.err == nil {
			s.err = err
		}
		out.broker.cpu += b.cpu
		out.broker.rss += b.rss
		out.broker.hwm += b.hwm
		if len(s.pids) > 1 {
			out.each = append(out.each, b.cpu)
		}
	}
	return out
}

// otherCores is the CPU, in cores, used between a and b by processes other
// than the generator and the broker.
func otherCores(a, b sample) float64 {
	win := b.at.Sub(a.at).Seconds()
	if win <= 0 {
		return 0
	}
	other := (b.system - a.system) - (b.self - a.self) - (b.broker.cpu - a.broker.cpu)
	return max(other.Seconds()/win, 0)
}
