// Package report summarises keel-bench results: medians per scenario and
// broker over repeated runs, and ratios between brokers.
package report

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/keelmq/keel/test/bench/loadgen"
)

// Ratio names two brokers to compare: Num / Den.
type Ratio struct{ Num, Den string }

// ParseRatios parses "keel/mosquitto,keel/mochi".
func ParseRatios(s string) ([]Ratio, error) {
	var out []Ratio
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		num, den, ok := strings.Cut(part, "/")
		if !ok || num == "" || den == "" {
			return nil, fmt.Errorf("ratio %q: want NUM/DEN", part)
		}
		out = append(out, Ratio{num, den})
	}
	return out, nil
}

// Read parses JSON lines of [loadgen.Result]; blank lines are skipped.
func Read(r io.Reader) ([]loadgen.Result, error) {
	var out []loadgen.Result
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var res loadgen.Result
		if err := json.Unmarshal([]byte(line), &res); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		out = append(out, res)
	}
	return out, sc.Err()
}

// Summary is the median of the runs of one scenario label on one broker.
type Summary struct {
	Label, Broker, Unit string
	Runs                int
	Rate, P50us, P99us  float64
	Lost, Dup, OOO      uint64 // summed over runs
	Errors              int    // summed over runs
	BrokerCores         float64
	CPUusPerOp          float64
	RSSMiB              float64
	PeakRSSMiB          float64
	GenCores            float64
	OtherCores          float64
	Rates               []float64 // every run, in run order
}

// Summarise groups results by label and broker, in order of first appearance.
func Summarise(results []loadgen.Result) []Summary {
	type key struct{ label, broker string }
	var order []key
	groups := map[key][]loadgen.Result{}
	for _, r := range results {
		k := key{r.Label, r.Broker}
		if k.label == "" {
			k.label = r.Scenario
		}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], r)
	}
	// Keep each label's brokers together, labels in first-seen order.
	var labels []string
	for _, k := range order {
		if !slices.Contains(labels, k.label) {
			labels = append(labels, k.label)
		}
	}
	var out []Summary
	for _, l := range labels {
		for _, k := range order {
			if k.label != l {
				continue
			}
			rs := groups[k]
			s := Summary{Label: k.label, Broker: k.broker, Unit: rs[0].Unit, Runs: len(rs)}
			med := func(f func(r loadgen.Result) float64) float64 {
				v := make([]float64, len(rs))
				for i, r := range rs {
					v[i] = f(r)
				}
				return Median(v)
			}
			s.Rate = med(func(r loadgen.Result) float64 { return r.Rate })
			s.P50us = med(func(r loadgen.Result) float64 { return r.P50us })
			s.P99us = med(func(r loadgen.Result) float64 { return r.P99us })
			s.BrokerCores = med(func(r loadgen.Result) float64 { return r.BrokerCores })
			s.CPUusPerOp = med(func(r loadgen.Result) float64 { return r.BrokerCPUusPer })
			s.RSSMiB = med(func(r loadgen.Result) float64 { return float64(r.BrokerRSS) / (1 << 20) })
			s.PeakRSSMiB = med(func(r loadgen.Result) float64 { return float64(r.BrokerPeakRSS) / (1 << 20) })
			s.GenCores = med(func(r loadgen.Result) float64 { return r.GenCores })
			s.OtherCores = med(func(r loadgen.Result) float64 { return r.OtherCores })
			for _, r := range rs {
				s.Lost += r.Lost
				s.Dup += r.Dup
				s.OOO += r.OOO
				s.Errors += r.Errors
				s.Rates = append(s.Rates, r.Rate)
			}
			out = append(out, s)
		}
	}
	return out
}

// Median returns the median of v (the mean of the middle two for even n).
func Median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// Write prints the figures table and the ratio table as Markdown.
func Write(w io.Writer, sums []Summary, ratios []Ratio) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintln(bw, "| scenario | broker | runs | rate (median) | unit | p50 µs | p99 µs | lost | dup | ooo | broker cores | broker CPU µs/op | broker RSS MiB | gen cores | other cores | runs' rates |")
	fmt.Fprintln(bw, "|---|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
	for _, s := range sums {
		lost := fmt.Sprint(s.Lost)
		if s.Errors > 0 {
			lost += fmt.Sprintf(" (%d errors)", s.Errors)
		}
		rates := make([]string, len(s.Rates))
		for i, r := range s.Rates {
			rates[i] = human(r)
		}
		fmt.Fprintf(bw, "| %s | %s | %d | %s | %s | %s | %s | %s | %d | %d | %.2f | %.2f | %.1f | %.2f | %.2f | %s |\n",
			s.Label, s.Broker, s.Runs, human(s.Rate), s.Unit, lat(s.P50us), lat(s.P99us), lost, s.Dup, s.OOO,
			s.BrokerCores, s.CPUusPerOp, s.RSSMiB, s.GenCores, s.OtherCores, strings.Join(rates, " "))
	}
	if len(ratios) > 0 {
		fmt.Fprintln(bw)
		var head, sep strings.Builder
		head.WriteString("| scenario |")
		sep.WriteString("|---|")
		for _, r := range ratios {
			fmt.Fprintf(&head, " %s/%s rate | %s/%s CPU/op |", r.Num, r.Den, r.Num, r.Den)
			sep.WriteString("--:|--:|")
		}
		fmt.Fprintln(bw, head.String())
		fmt.Fprintln(bw, sep.String())
		var labels []string
		for _, s := range sums {
			if !slices.Contains(labels, s.Label) {
				labels = append(labels, s.Label)
			}
		}
		find := func(label, broker string) *Summary {
			for i := range sums {
				if sums[i].Label == label && sums[i].Broker == broker {
					return &sums[i]
				}
			}
			return nil
		}
		for _, l := range labels {
			fmt.Fprintf(bw, "| %s |", l)
			for _, r := range ratios {
				n, d := find(l, r.Num), find(l, r.Den)
				if n == nil || d == nil {
					fmt.Fprint(bw, " n/a | n/a |")
					continue
				}
				fmt.Fprintf(bw, " %s | %s |", ratio(n.Rate, d.Rate), ratio(n.CPUusPerOp, d.CPUusPerOp))
			}
			fmt.Fprintln(bw)
		}
		fmt.Fprintln(bw)
		fmt.Fprintln(bw, "rate: higher is better, except B/client (memory per idle client), where lower is better; CPU/op: lower is better.")
	}
	return bw.Flush()
}

func ratio(a, b float64) string {
	if b == 0 || a == 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

func human(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e4:
		return fmt.Sprintf("%.0fk", v/1e3)
	case v >= 1e3:
		return fmt.Sprintf("%.1fk", v/1e3)
	default:
		return fmt.Sprintf("%.0f", v)
	}
}

func lat(us float64) string {
	if us >= 1e4 {
		return fmt.Sprintf("%.0fk", us/1e3)
	}
	return fmt.Sprintf("%.0f", us)
}
