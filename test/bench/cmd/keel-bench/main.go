// Command keel-bench is an MQTT 3.1.1 load generator for comparing Keel with
// other brokers. It speaks MQTT on raw TCP through a small codec so that the
// generator is not the bottleneck. See package loadgen for the scenarios.
//
//	keel-bench -scenario fanin -qos 1 -clients 50 -duration 10s -pub-addr 127.0.0.1:1883 -sub-addr 127.0.0.1:1883
//	keel-bench -scenario failover -clients 1000 -addrs 127.0.0.1:1883,127.0.0.1:1884,127.0.0.1:1885 \
//	  -kill-pid <pid of the third edge> -killed-addr 127.0.0.1:1885
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"syscall"

	"github.com/keelmq/keel/test/bench/loadgen"
)

func main() {
	os.Exit(run())
}

func run() int {
	fs := flag.NewFlagSet("keel-bench", flag.ContinueOnError)
	var cfg loadgen.Config
	cfg.RegisterFlags(fs)
	addr := fs.String("addr", "", "broker address for publishers and subscribers (overrides -pub-addr and -sub-addr)")
	asJSON := fs.Bool("json", false, "print the result as one JSON object")
	textOut := fs.String("text-out", "", "also write the human-readable result to this file")
	waitQuiet := fs.Duration("wait-quiet", 0, "first wait up to this long for the machine to be idle (see -quiet-cores)")
	quietCores := fs.Float64("quiet-cores", 0.3, "CPU use, in cores, below which the machine counts as idle")
	procs := fs.Int("procs", 1, "GOMAXPROCS for the generator, unless the GOMAXPROCS variable is set (0 = runtime default)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the generator to this file")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return 2
	}
	// NOTE: one P by default. On 2 cores shared with the broker, a second P
	// makes the Go scheduler hand goroutines between two threads on every
	// small read: against Mosquitto fan-in (which sends many small segments)
	// the generator then used 0.6 cores instead of 0.13 for the same load,
	// and Mosquitto got half the throughput. One P drives 300k msgs/s.
	if _, set := os.LookupEnv("GOMAXPROCS"); !set && *procs > 0 {
		runtime.GOMAXPROCS(*procs)
	}
	if *addr != "" {
		cfg.PubAddr, cfg.SubAddr = *addr, *addr
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	if *waitQuiet > 0 {
		if busy := loadgen.WaitQuiet(ctx, *quietCores, *waitQuiet); busy >= *quietCores {
			fmt.Fprintf(os.Stderr, "keel-bench: machine still busy (%.2f cores) after %s; running anyway\n", busy, *waitQuiet)
		}
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintf(os.Stderr, "keel-bench: %v\n", err)
			return 1
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintf(os.Stderr, "keel-bench: %v\n", err)
			return 1
		}
		defer pprof.StopCPUProfile()
	}
	res, err := loadgen.Run(ctx, cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "keel-bench: %v\n", err)
		return 1
	}
	if *textOut != "" {
		if err := os.WriteFile(*textOut, []byte(res.String()), 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "keel-bench: %v\n", err)
			return 1
		}
	}
	if *asJSON {
		if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
			fmt.Fprintf(os.Stderr, "keel-bench: %v\n", err)
			return 1
		}
	} else {
		fmt.Print(res.String())
	}
	if res.Errors > 0 {
		return 1
	}
	return 0
}
