// Command bench-report reads keel-bench -json results (one per line) and
// prints Markdown tables: medians per scenario and broker, and broker ratios.
//
//	bench-report -ratios keel/mosquitto,keel/mochi results.jsonl
package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/keelmq/keel/test/bench/report"
)

func main() {
	ratios := flag.String("ratios", "keel/mosquitto,keel/mochi,mochi/mosquitto", "comma-separated NUM/DEN broker ratios")
	flag.Parse()
	rs, err := report.ParseRatios(*ratios)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-report:", err)
		os.Exit(2)
	}
	var in io.Reader = os.Stdin
	if flag.NArg() > 0 {
		f, err := os.Open(flag.Arg(0))
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench-report:", err)
			os.Exit(1)
		}
		defer f.Close()
		in = f
	}
	results, err := report.Read(in)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-report:", err)
		os.Exit(1)
	}
	if err := report.Write(os.Stdout, report.Summarise(results), rs); err != nil {
		fmt.Fprintln(os.Stderr, "bench-report:", err)
		os.Exit(1)
	}
}
