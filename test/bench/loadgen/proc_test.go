package loadgen

import (
	"os"
	"testing"
	"time"
)

func TestSplitPIDs(t *testing.T) {
	got, err := splitPIDs(" 12, 34,,56 ")
	if err != nil || len(got) != 3 || got[0] != 12 || got[1] != 34 || got[2] != 56 {
		t.Fatalf("splitPIDs = %v, %v", got, err)
	}
	for _, bad := range []string{"x", "1,-2", "0"} {
		if _, err := splitPIDs(bad); err == nil {
			t.Fatalf("splitPIDs(%q): no error", bad)
		}
	}
}

// A broker of several processes is sampled as their sum, each one's CPU
// kept in order. The test process stands for both (the same pid twice), so
// the sum is exactly twice one reading only if both read the same tick:
// the check is that the sum is the sum of the parts.
func TestSampler_SumsTheBrokersProcesses(t *testing.T) {
	cfg := &Config{BrokerPID: os.Getpid(), BrokerPIDs: []int{os.Getpid()}}
	smp := newSampler(cfg)
	var x uint64
	for selfCPU() < 50*time.Millisecond { // some CPU to read, past /proc's 10 ms tick
		for i := range 1_000_000 {
			x += uint64(i) * 7
		}
	}
	s := smp.take()
	if smp.err != nil {
		t.Fatal(smp.err)
	}
	if len(s.each) != 2 {
		t.Fatalf("each = %v, want 2 readings (x %d)", s.each, x)
	}
	if s.broker.cpu != s.each[0]+s.each[1] || s.broker.cpu <= 0 {
		t.Fatalf("broker cpu %v, each %v", s.broker.cpu, s.each)
	}
	if one := newSampler(&Config{BrokerPID: os.Getpid()}); len(one.take().each) != 0 {
		t.Fatal("a one-process broker keeps no per-process readings")
	}
	if none := newSampler(&Config{BrokerPIDs: []int{os.Getpid()}}); none.take().broker.cpu != 0 {
		t.Fatal("no broker pid: nothing sampled")
	}
}
