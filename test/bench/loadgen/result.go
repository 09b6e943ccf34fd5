package loadgen

import (
	"fmt"
	"strings"
	"time"
)

// Result is what one run measured. Rates count only the measured window
// (after warmup); loss, duplicate and reorder counts cover the whole run.
type Result struct {
	Broker   string `json:"broker,omitempty"`
	Label    string `json:"label,omitempty"`
	Scenario string `json:"scenario"`
	QoS      int    `json:"qos"`
	Size     int    `json:"size"`
	Clients  int    `json:"clients"`
	Pubs     int    `json:"publishers,omitempty"`
	Subs     int    `json:"subscribers,omitempty"`
	Inflight int    `json:"inflight,omitempty"`
	// PacedRate is the open-loop rate the publishers were paced to
	// (Config.Rate), 0 in closed loop.
	PacedRate float64 `json:"paced_rate,omitempty"`

	Seconds float64 `json:"seconds"` // length of the measured window

	// Rate is the headline figure: deliveries/s for message scenarios
	// (= msgs/s except in fan-out), connects/s for storm, 0 for idle.
	Rate          float64 `json:"rate"`
	Unit          string  `json:"unit"`
	PublishedRate float64 `json:"published_per_sec,omitempty"`
	P50us         float64 `json:"p50_us"`
	P90us         float64 `json:"p90_us"`
	P99us         float64 `json:"p99_us"`
	MaxUs         float64 `json:"max_us"`

	Sent      uint64 `json:"sent,omitempty"`      // published, whole run
	Acked     uint64 `json:"acked,omitempty"`     // PUBACK/PUBCOMP received, QoS 1/2
	Delivered uint64 `json:"delivered,omitempty"` // received by subscribers, whole run
	Lost      uint64 `json:"lost"`                // QoS 0: sent, QoS 1/2: acked; never received
	Dup       uint64 `json:"dup"`
	OOO       uint64 `json:"ooo"`
	Unacked   uint64 `json:"unacked,omitempty"` // QoS 1/2: published, no ack by the end
	Stalls    uint64 `json:"stalls,omitempty"`  // windows reopened after StallTimeout
	PIDWaits  uint64 `json:"pid_waits,omitempty"`
	Foreign   uint64 `json:"foreign,omitempty"` // messages from another run on the same topics

	ConnectErrors uint64  `json:"connect_errors,omitempty"`
	DisconnectSec float64 `json:"disconnect_seconds,omitempty"`

	// Broker figures need Config.BrokerPID.
	BrokerCPUSec    float64 `json:"broker_cpu_seconds,omitempty"`
	BrokerCores     float64 `json:"broker_cores,omitempty"`
	BrokerCPUusPer  float64 `json:"broker_cpu_us_per_op,omitempty"`
	BrokerRSS       int64   `json:"broker_rss_bytes,omitempty"`
	BrokerPeakRSS   int64   `json:"broker_peak_rss_bytes,omitempty"`
	RSSPerClient    float64 `json:"broker_rss_per_client_bytes,omitempty"`
	BrokerSampleErr string  `json:"broker_sample_error,omitempty"`
	// BrokerCPUusPerProc is BrokerCPUusPer of each broker process, in the
	// order of -broker-pid then -broker-pids (set with -broker-pids).
	BrokerCPUusPerProc []float64 `json:"broker_cpu_us_per_op_by_process,omitempty"`

	// Errors counts connections that failed during the run; FirstError is
	// the first of them. A run with errors is not a valid measurement.
	Errors     int    `json:"errors,omitempty"`
	FirstError string `json:"first_error,omitempty"`

	// Failover has the failover scenario's figures; its Rate is the seconds
	// from the kill until everyone was back and every acknowledged message
	// delivered (0 if that never happened), and Seconds the time from the
	// kill to the end of the wait.
	Failover *FailoverResult `json:"failover,omitempty"`

	// GenCores is the load generator's own CPU use in the window, to check
	// that it is not the bottleneck.
	GenCores float64 `json:"gen_cores"`
	// OtherCores is CPU used by every other process on the machine during
	// the window (needs BrokerPID to exclude the broker). On a shared
	// machine, a run with OtherCores well above zero measured a contended
	// machine.
	OtherCores float64 `json:"other_cores"`
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// String renders the result for a terminal.
func (r *Result) String() string {
	var b strings.Builder
	name := r.Scenario
	if r.Label != "" {
		name = r.Label
	}
	if r.Broker != "" {
		name += " @ " + r.Broker
	}
	fmt.Fprintf(&b, "%s: qos=%d size=%dB clients=%d", name, r.QoS, r.Size, r.Clients)
	if r.Pubs > 0 {
		fmt.Fprintf(&b, " (pubs=%d subs=%d inflight=%d)", r.Pubs, r.Subs, r.Inflight)
		if r.PacedRate > 0 {
			fmt.Fprintf(&b, " paced at %.0f msgs/s", r.PacedRate)
		}
	}
	fmt.Fprintf(&b, " window=%.1fs\n", r.Seconds)
	switch r.Scenario {
	case ScenarioFailover:
		if r.Failover != nil {
			b.WriteString(r.Failover.String())
		}
	case ScenarioIdle:
		fmt.Fprintf(&b, "  connected %d clients; broker rss %.1f MiB, %.0f B/client\n",
			r.Clients-int(r.ConnectErrors), float64(r.BrokerRSS)/(1<<20), r.RSSPerClient)
	default:
		fmt.Fprintf(&b, "  %.0f %s  p50 %.0fµs  p90 %.0fµs  p99 %.0fµs  max %.0fµs\n",
			r.Rate, r.Unit, r.P50us, r.P90us, r.P99us, r.MaxUs)
	}
	if r.Scenario != ScenarioStorm && r.Scenario != ScenarioIdle {
		fmt.Fprintf(&b, "  sent %d acked %d delivered %d  lost %d dup %d ooo %d unacked %d stalls %d\n",
			r.Sent, r.Acked, r.Delivered, r.Lost, r.Dup, r.OOO, r.Unacked, r.Stalls)
	}
	if r.ConnectErrors > 0 {
		fmt.Fprintf(&b, "  connect errors %d\n", r.ConnectErrors)
	}
	if r.BrokerRSS > 0 {
		fmt.Fprintf(&b, "  broker: %.2f cores, %.2f µs CPU/op, rss %.1f MiB (peak %.1f MiB)\n",
			r.BrokerCores, r.BrokerCPUusPer, float64(r.BrokerRSS)/(1<<20), float64(r.BrokerPeakRSS)/(1<<20))
	}
	if len(r.BrokerCPUusPerProc) > 0 {
		fmt.Fprintf(&b, "  broker µs CPU/op by process:")
		for _, v := range r.BrokerCPUusPerProc {
			fmt.Fprintf(&b, " %.2f", v)
		}
		b.WriteString("\n")
	}
	if r.BrokerSampleErr != "" {
		fmt.Fprintf(&b, "  broker sampling: %s\n", r.BrokerSampleErr)
	}
	fmt.Fprintf(&b, "  generator: %.2f cores; other processes: %.2f cores\n", r.GenCores, r.OtherCores)
	if r.Errors > 0 {
		fmt.Fprintf(&b, "  ERRORS: %d connections failed; first: %s\n", r.Errors, r.FirstError)
	}
	return b.String()
}
