// Package loadgen drives MQTT 3.1.1 load against a broker and measures it:
// throughput, end-to-end latency, loss, duplicates and reordering, and, when
// given the broker's pid, the broker's CPU time and resident memory.
//
// Scenarios are closed loops: a fixed window of messages is in flight across
// all publishers, and a message leaves the window when its subscriber(s)
// receive it. That finds saturation throughput without overflowing broker
// queues (see shared/notes/peers.md). The MQTT client is the raw-TCP codec of
// package [github.com/keelmq/keel/test/bench/wire], so one process can drive
// several hundred thousand messages per second on two cores.
package loadgen

import (
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Scenario names.
const (
	// ScenarioFanIn is N publishers on distinct topics to 1 subscriber on a wildcard.
	ScenarioFanIn = "fanin"
	// ScenarioFanOut is 1 publisher to N subscribers of one topic.
	ScenarioFanOut = "fanout"
	// ScenarioPairs is N publisher/subscriber pairs on distinct topics.
	ScenarioPairs = "pairs"
	// ScenarioStorm connects N clients as fast as possible, then disconnects them.
	ScenarioStorm = "storm"
	// ScenarioIdle connects N clients, holds them idle and reports the broker's
	// resident memory per client.
	ScenarioIdle = "idle"
	// ScenarioFailover spreads N persistent QoS 1 subscribers over several
	// edges, kills one edge, and measures how long its clients take to come
	// back on the others and to get every acknowledged message (failover.go).
	ScenarioFailover = "failover"
)

// Defaults for [Config.RegisterFlags].
const (
	DefaultScenario           = ScenarioFanIn
	DefaultSize               = 64
	DefaultClients            = 50
	DefaultDuration           = 10 * time.Second
	DefaultWarmup             = 2 * time.Second
	DefaultInflight           = 1000
	DefaultAddr               = "127.0.0.1:1883"
	DefaultDrain              = 5 * time.Second
	DefaultKeepAlive          = 60
	DefaultTopicPrefix        = "bench"
	DefaultConnectConcurrency = 100
	DefaultIdleHold           = 3 * time.Second
	DefaultStallTimeout       = time.Second
	DefaultKillAfter          = time.Second
	// DefaultAckTimeout is longer than the Keel edge's default
	// --cluster.forward-timeout (30 s), after which the edge itself closes a
	// publisher whose forwards did not complete.
	DefaultAckTimeout     = 40 * time.Second
	DefaultRecoverTimeout = 2 * time.Minute

	// MinSize is the smallest payload: it carries run id, publisher id,
	// sequence number and send time.
	MinSize = headerSize
)

// Config describes one load-generator run.
type Config struct {
	Scenario string
	QoS      int
	Size     int // payload bytes
	Clients  int // publishers (fanin), subscribers (fanout), pairs, or connections (storm, idle)
	Duration time.Duration
	Warmup   time.Duration
	// Inflight is the closed-loop window: messages in flight across all
	// publishers, split evenly between them (at least one each).
	Inflight int
	// Rate, when above 0, paces the publishers (open loop): this many
	// messages a second across all of them, each publisher sending its
	// share at even intervals from a phase of its own, within the window
	// still. A latency measured so reflects the path a message takes, not
	// a queue the generator keeps full.
	Rate    float64
	PubAddr string
	SubAddr string
	// Drain is how long to wait after the run for messages still in flight
	// before counting what never arrived as lost.
	Drain       time.Duration
	KeepAlive   int // seconds
	TopicPrefix string
	// ConnectConcurrency bounds parallel connection attempts.
	ConnectConcurrency int
	// Hold is how long storm and idle keep their clients connected before
	// sampling memory and disconnecting. It must stay below the keep alive.
	Hold time.Duration
	// Ping makes idle clients exchange one PINGREQ/PINGRESP once all are
	// connected, before the hold: a broker's memory for a client that has
	// sent a packet since its CONNECT, as every live client does at least
	// once per keep alive, can differ from that for one that has not.
	Ping bool
	// StallTimeout is how long a publisher waits with a full window and no
	// progress before it assumes the window's messages lost and reopens it.
	StallTimeout time.Duration
	// BrokerPID, if set, is the broker process sampled for CPU and memory.
	BrokerPID int
	// BrokerPIDs are more processes of the broker (the other edges of a
	// cluster): their CPU and memory add to BrokerPID's, and the flow
	// scenarios also report each process's CPU per message.
	BrokerPIDs []int
	// Username and Password are sent in CONNECT when Username is set.
	Username string
	Password string
	// Persistent makes subscribers keep persistent sessions (clean session
	// off): every message to them is stored before it is acknowledged. Their
	// sessions are ended after the run.
	Persistent bool

	// Failover scenario. Addrs are the edges' MQTT addresses; subscribers
	// are spread over them round-robin. KillPID, if set, is sent SIGKILL
	// KillAfter after the first round is acknowledged; KilledAddr is that
	// process's address, which nobody reconnects to. AckTimeout is how long
	// the publisher waits for a PUBACK before it resends on another edge.
	// RecoverTimeout bounds the wait, from the kill, for every client to be
	// back and every publish acknowledged; Drain then bounds the wait for
	// deliveries.
	Addrs          []string
	KillPID        int
	KillAfter      time.Duration
	KilledAddr     string
	AckTimeout     time.Duration
	RecoverTimeout time.Duration

	// Broker and Label are copied into the result to tag it.
	Broker string
	Label  string

	// kill, when set, replaces sending SIGKILL to KillPID (tests).
	kill func() error
}

// RegisterFlags registers the config's flags on fs with their defaults.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Scenario, "scenario", DefaultScenario, "fanin | fanout | pairs | storm | idle | failover")
	fs.IntVar(&c.QoS, "qos", 0, "QoS of publishes and subscriptions: 0, 1 or 2")
	fs.IntVar(&c.Size, "size", DefaultSize, fmt.Sprintf("payload bytes (at least %d)", MinSize))
	fs.IntVar(&c.Clients, "clients", DefaultClients, "publishers (fanin), subscribers (fanout), pairs, or connections (storm, idle)")
	fs.DurationVar(&c.Duration, "duration", DefaultDuration, "measured duration")
	fs.DurationVar(&c.Warmup, "warmup", DefaultWarmup, "unmeasured load before the measured duration")
	fs.IntVar(&c.Inflight, "inflight", DefaultInflight, "closed-loop window: messages in flight across all publishers")
	fs.Float64Var(&c.Rate, "rate", 0, "open loop: messages per second across all publishers (0: as fast as the window allows)")
	fs.StringVar(&c.PubAddr, "pub-addr", DefaultAddr, "broker address for publishers (and storm/idle clients)")
	fs.StringVar(&c.SubAddr, "sub-addr", DefaultAddr, "broker address for subscribers")
	fs.DurationVar(&c.Drain, "drain", DefaultDrain, "longest wait for in-flight messages after the run")
	fs.IntVar(&c.KeepAlive, "keepalive", DefaultKeepAlive, "MQTT keep alive in seconds")
	fs.StringVar(&c.TopicPrefix, "topic-prefix", DefaultTopicPrefix, "first topic level")
	fs.IntVar(&c.ConnectConcurrency, "connect-concurrency", DefaultConnectConcurrency, "parallel connection attempts")
	fs.BoolVar(&c.Ping, "ping", false, "idle: every client sends one PINGREQ (and reads its PINGRESP) before the hold")
	fs.DurationVar(&c.Hold, "hold", 0, fmt.Sprintf("storm/idle: time connected before sampling memory (idle default %s)", DefaultIdleHold))
	fs.DurationVar(&c.StallTimeout, "stall-timeout", DefaultStallTimeout, "reopen a publisher's window after this long without progress")
	fs.IntVar(&c.BrokerPID, "broker-pid", 0, "broker pid to sample CPU and RSS from /proc")
	fs.Func("broker-pids", "comma-separated pids of more broker processes (a cluster's other edges), sampled with -broker-pid", func(v string) error {
		pids, err := splitPIDs(v)
		c.BrokerPIDs = pids
		return err
	})
	fs.StringVar(&c.Username, "username", "", "CONNECT username")
	fs.BoolVar(&c.Persistent, "persistent", false, "subscribers keep persistent sessions (clean session off), ended after the run")
	fs.StringVar(&c.Password, "password", "", "CONNECT password (needs -username)")
	fs.Func("addrs", "failover: comma-separated MQTT addresses of the edges", func(v string) error {
		c.Addrs = splitAddrs(v)
		return nil
	})
	fs.IntVar(&c.KillPID, "kill-pid", 0, "failover: pid to send SIGKILL (an edge's)")
	fs.DurationVar(&c.KillAfter, "kill-after", DefaultKillAfter, "failover: wait this long after the first round is acknowledged, then kill")
	fs.StringVar(&c.KilledAddr, "killed-addr", "", "failover: MQTT address of the killed edge (one of -addrs)")
	fs.DurationVar(&c.AckTimeout, "ack-timeout", DefaultAckTimeout, "failover: resend on another edge when a PUBACK takes longer than this")
	fs.DurationVar(&c.RecoverTimeout, "recover-timeout", DefaultRecoverTimeout, "failover: longest wait after the kill for all clients back and all publishes acknowledged")
	fs.StringVar(&c.Broker, "broker", "", "broker name copied into the result")
	fs.StringVar(&c.Label, "label", "", "run label copied into the result")
}

// Validate checks the config and fills scenario-dependent defaults.
func (c *Config) Validate() error {
	var errs []error
	switch c.Scenario {
	case ScenarioFanIn, ScenarioFanOut, ScenarioPairs, ScenarioStorm:
	case ScenarioIdle:
		if c.Hold == 0 {
			c.Hold = DefaultIdleHold
		}
	case ScenarioFailover:
		// Persistent sessions and QoS 1 are what the scenario measures.
		c.QoS, c.Persistent = 1, true
		errs = append(errs, c.validateFailover()...)
	default:
		errs = append(errs, fmt.Errorf("unknown scenario %q", c.Scenario))
	}
	if c.QoS < 0 || c.QoS > 2 {
		errs = append(errs, fmt.Errorf("qos %d not in 0..2", c.QoS))
	}
	if c.Size < MinSize {
		errs = append(errs, fmt.Errorf("size %d below %d", c.Size, MinSize))
	}
	if c.Clients < 1 {
		errs = append(errs, errors.New("clients must be at least 1"))
	}
	if c.Duration <= 0 || c.Warmup < 0 || c.Drain < 0 || c.Hold < 0 {
		errs = append(errs, errors.New("duration must be positive; warmup, drain and hold not negative"))
	}
	if c.Inflight < 1 {
		errs = append(errs, errors.New("inflight must be at least 1"))
	}
	if c.Rate < 0 {
		errs = append(errs, errors.New("rate must not be negative"))
	}
	if c.KeepAlive < 0 || c.KeepAlive > 65535 {
		errs = append(errs, fmt.Errorf("keepalive %d not in 0..65535", c.KeepAlive))
	}
	if c.KeepAlive > 0 && c.Hold >= time.Duration(c.KeepAlive)*time.Second {
		errs = append(errs, errors.New("hold must be shorter than the keep alive (idle clients send no PINGREQ of their own)"))
	}
	if c.ConnectConcurrency < 1 {
		c.ConnectConcurrency = 1
	}
	if c.StallTimeout <= 0 {
		c.StallTimeout = DefaultStallTimeout
	}
	if c.Password != "" && c.Username == "" {
		errs = append(errs, errors.New("password needs a username"))
	}
	if c.Scenario != ScenarioFailover && (c.PubAddr == "" || c.SubAddr == "") {
		errs = append(errs, errors.New("pub-addr and sub-addr must be set"))
	}
	return errors.Join(errs...)
}

// validateFailover checks the failover flags and fills their defaults.
func (c *Config) validateFailover() []error {
	var errs []error
	if len(c.Addrs) < 2 {
		errs = append(errs, errors.New("failover needs -addrs with at least two addresses"))
	}
	if c.KilledAddr != "" && addrIndex(c.Addrs, c.KilledAddr) < 0 {
		errs = append(errs, fmt.Errorf("killed-addr %s is not one of -addrs", c.KilledAddr))
	}
	if (c.KillPID > 0 || c.kill != nil) != (c.KilledAddr != "") {
		errs = append(errs, errors.New("kill-pid and killed-addr go together"))
	}
	if c.KillPID < 0 || c.KillAfter < 0 {
		errs = append(errs, errors.New("kill-pid and kill-after must not be negative"))
	}
	if c.AckTimeout <= 0 {
		c.AckTimeout = DefaultAckTimeout
	}
	if c.RecoverTimeout <= 0 {
		c.RecoverTimeout = DefaultRecoverTimeout
	}
	// Packet ids of one connection: the window must fit in them.
	c.Inflight = min(c.Inflight, 65000)
	return errs
}

// splitAddrs splits a comma- or space-separated address list.
func splitAddrs(v string) []string {
	return strings.FieldsFunc(v, func(r rune) bool { return r == ',' || r == ' ' })
}

// addrIndex returns the index of addr in addrs, or -1.
func addrIndex(addrs []string, addr string) int {
	return slices.Index(addrs, addr)
}
