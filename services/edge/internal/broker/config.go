package broker

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"time"
)

// Config holds the MQTT limits and behaviour of the edge.
type Config struct {
	EdgeID         string `yaml:"edge_id"`
	MaxPacketSize  uint32 `yaml:"max_packet_size"`
	MaxConnections int64  `yaml:"max_connections"`
	// LoadConnections and LoadMessageRate are what counts as a fully loaded
	// edge in keel_edge_load_score (autoscaling).
	LoadConnections   int64         `yaml:"load_connections"`
	LoadMessageRate   float64       `yaml:"load_message_rate"`
	ReceiveMaximum    uint16        `yaml:"receive_maximum"`
	MaxInflight       uint16        `yaml:"max_inflight"`
	TopicAliasMaximum uint16        `yaml:"topic_alias_maximum"`
	MaxTopicLength    int           `yaml:"max_topic_length"`
	MaxTopicLevels    int           `yaml:"max_topic_levels"`
	MaxClientIDLength int           `yaml:"max_client_id_length"`
	MaxSubscriptions  int           `yaml:"max_subscriptions"`
	PublishRate       float64       `yaml:"publish_rate"`
	PublishBurst      int           `yaml:"publish_burst"`
	ConnectTimeout    time.Duration `yaml:"connect_timeout"`
	MaxKeepAlive      uint16        `yaml:"max_keepalive"`
	MaxSessionExpiry  uint32        `yaml:"max_session_expiry"`
	MaxMessageExpiry  int64         `yaml:"max_message_expiry"`
	QueueLen          int           `yaml:"queue_len"`
	QueueBytes        int           `yaml:"queue_bytes"`
	OfflineQueueLen   int           `yaml:"offline_queue_len"`
	OfflineQueueBytes int           `yaml:"offline_queue_bytes"`
	OfflineDropOldest bool          `yaml:"offline_drop_oldest"`
	QueueQoS0Offline  bool          `yaml:"queue_qos0_offline"`
	SlowConsumerGrace time.Duration `yaml:"slow_consumer_grace"`
	WriteTimeout      time.Duration `yaml:"write_timeout"`
	RetainDisabled    bool          `yaml:"retain_disabled"`
	SharedDisabled    bool          `yaml:"shared_disabled"`
	AuthMaxFailures   int           `yaml:"auth_max_failures"`
	AuthFailureWindow time.Duration `yaml:"auth_failure_window"`
	AuthBanDuration   time.Duration `yaml:"auth_ban_duration"`
	ConnectRate       float64       `yaml:"connect_rate"`
	ConnectBurst      int           `yaml:"connect_burst"`
	// HandoverMemory is how long the subscriptions of a session handed over
	// to another edge are remembered, so that a message published before the
	// handover and arriving after it is refused rather than taken by nobody;
	// the forward timeout (cluster.forward-timeout) bounds how late one can
	// arrive. Zero: 30 s.
	HandoverMemory time.Duration `yaml:"-"`
	// ForwardBound is how long, from its ingress, a QoS 1/2 publish that an
	// edge left the cluster without taking is routed again before its
	// publisher is closed unacknowledged (cluster.forward-timeout, set only
	// with cluster.forward-retry). Zero: it is not routed again; the
	// publisher is closed at once.
	ForwardBound time.Duration `yaml:"-"`
	// ResolveBound is how long, from its ingress, a QoS 1/2 publish whose
	// routes name an edge that left the cluster (they outlive it until its
	// sessions are adopted) is routed again, before anything of it was
	// delivered, until the routes name live edges; then its publisher is
	// closed unacknowledged (cluster.forward-timeout). Zero: the publisher
	// is closed at once.
	ResolveBound time.Duration `yaml:"-"`
}

// Defaults for [Config].
const (
	DefaultMaxPacketSize     = 1 << 20
	DefaultReceiveMaximum    = 1024
	DefaultMaxInflight       = 1024
	DefaultTopicAliasMaximum = 1024
	DefaultMaxTopicLength    = 4096
	DefaultMaxTopicLevels    = 64
	DefaultMaxClientIDLength = 256
	DefaultMaxSubscriptions  = 1000
	DefaultConnectTimeout    = 10 * time.Second
	DefaultQueueLen          = 4096
	DefaultQueueBytes        = 32 << 20
	DefaultOfflineQueueLen   = 10000
	DefaultOfflineQueueBytes = 64 << 20
	DefaultSlowConsumerGrace = 10 * time.Second
	DefaultWriteTimeout      = 30 * time.Second
	DefaultMaxMessageExpiry  = 7 * 24 * 3600
	DefaultLoadConnections   = 50_000
	DefaultLoadMessageRate   = 100_000
)

// RegisterFlags registers the config's flags under prefix (e.g. "mqtt.").
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.StringVar(&c.EdgeID, prefix+"edge-id", "", "ID of this edge (default: host name)")
	u32(fs, &c.MaxPacketSize, prefix+"max-packet-size", DefaultMaxPacketSize, "largest MQTT packet accepted or sent, in bytes")
	fs.Int64Var(&c.MaxConnections, prefix+"max-connections", math.MaxInt64, "most concurrent client connections")
	u16(fs, &c.ReceiveMaximum, prefix+"receive-maximum", DefaultReceiveMaximum, "QoS 1/2 publishes a client may have unacknowledged towards the edge")
	u16(fs, &c.MaxInflight, prefix+"max-inflight", DefaultMaxInflight, "QoS 1/2 messages the edge keeps unacknowledged towards one client")
	u16(fs, &c.TopicAliasMaximum, prefix+"topic-alias-maximum", DefaultTopicAliasMaximum, "topic aliases a client may use towards the edge")
	fs.IntVar(&c.MaxTopicLength, prefix+"max-topic-length", DefaultMaxTopicLength, "longest topic name or filter, in bytes")
	fs.IntVar(&c.MaxTopicLevels, prefix+"max-topic-levels", DefaultMaxTopicLevels, "most levels in a topic name or filter")
	fs.IntVar(&c.MaxClientIDLength, prefix+"max-client-id-length", DefaultMaxClientIDLength, "longest client ID, in bytes")
	fs.IntVar(&c.MaxSubscriptions, prefix+"max-subscriptions", DefaultMaxSubscriptions, "most subscriptions per session")
	fs.Float64Var(&c.PublishRate, prefix+"publish-rate", 0, "publishes per second per client before the edge slows its reading (0: no limit)")
	fs.IntVar(&c.PublishBurst, prefix+"publish-burst", 100, "burst allowed above publish-rate")
	fs.DurationVar(&c.ConnectTimeout, prefix+"connect-timeout", DefaultConnectTimeout, "time a new connection has to send CONNECT")
	u16(fs, &c.MaxKeepAlive, prefix+"max-keepalive", 0, "largest keep-alive in seconds; larger or zero requests get this as server keep-alive (0: no cap)")
	u32(fs, &c.MaxSessionExpiry, prefix+"max-session-expiry", math.MaxUint32, "largest session expiry interval in seconds")
	fs.Int64Var(&c.MaxMessageExpiry, prefix+"max-message-expiry", DefaultMaxMessageExpiry, "largest message expiry interval in seconds")
	fs.IntVar(&c.QueueLen, prefix+"queue-len", DefaultQueueLen, "messages queued for a connected client before publishers are held back")
	fs.IntVar(&c.QueueBytes, prefix+"queue-bytes", DefaultQueueBytes, "bytes queued for a connected client before publishers are held back")
	fs.IntVar(&c.OfflineQueueLen, prefix+"offline-queue-len", DefaultOfflineQueueLen, "messages queued for a persistent session")
	fs.IntVar(&c.OfflineQueueBytes, prefix+"offline-queue-bytes", DefaultOfflineQueueBytes, "bytes of messages (payload, topic and 64 of overhead each) queued for a persistent session (0: no byte bound)")
	fs.BoolVar(&c.OfflineDropOldest, prefix+"offline-drop-oldest", false, "when a session queue is full drop the oldest message (default: refuse the newest)")
	fs.BoolVar(&c.QueueQoS0Offline, prefix+"queue-qos0-offline", false, "queue QoS 0 messages for offline persistent sessions")
	fs.DurationVar(&c.SlowConsumerGrace, prefix+"slow-consumer-grace", DefaultSlowConsumerGrace, "how long a full client queue holds publishers back before a non-persistent client is disconnected (0x97)")
	fs.DurationVar(&c.WriteTimeout, prefix+"write-timeout", DefaultWriteTimeout, "deadline for one socket write to a client")
	fs.BoolVar(&c.RetainDisabled, prefix+"retain-disabled", false, "do not store retained messages")
	fs.BoolVar(&c.SharedDisabled, prefix+"shared-disabled", false, "refuse shared subscriptions")
	fs.IntVar(&c.AuthMaxFailures, prefix+"auth-max-failures", 10, "failed authentications from one IP address within auth-failure-window before the address is banned (0: never ban)")
	fs.DurationVar(&c.AuthFailureWindow, prefix+"auth-failure-window", time.Minute, "window in which failed authentications are counted")
	fs.DurationVar(&c.AuthBanDuration, prefix+"auth-ban-duration", 5*time.Minute, "how long a ban lasts")
	fs.Float64Var(&c.ConnectRate, prefix+"connect-rate", 0, "new connections per second admitted per listener (0: no limit)")
	fs.Int64Var(&c.LoadConnections, prefix+"load-connections", DefaultLoadConnections, "connections that count as full load in keel_edge_load_score")
	fs.Float64Var(&c.LoadMessageRate, prefix+"load-message-rate", DefaultLoadMessageRate, "inbound messages per second that count as full load in keel_edge_load_score")
	fs.IntVar(&c.ConnectBurst, prefix+"connect-burst", 1000, "burst of new connections above connect-rate")
}

// Validate checks the config.
func (c *Config) Validate() error {
	var errs []error
	if c.QueueLen <= 0 || c.QueueBytes <= 0 {
		errs = append(errs, errors.New("queue-len and queue-bytes must be positive"))
	}
	if c.OfflineQueueLen < c.QueueLen {
		errs = append(errs, fmt.Errorf("offline-queue-len (%d) must be at least queue-len (%d)", c.OfflineQueueLen, c.QueueLen))
	}
	if c.MaxInflight == 0 || c.ReceiveMaximum == 0 {
		errs = append(errs, errors.New("max-inflight and receive-maximum must be positive"))
	}
	if c.MaxPacketSize != 0 && c.MaxPacketSize < 64 {
		errs = append(errs, errors.New("max-packet-size must be 0 or at least 64"))
	}
	if c.LoadConnections <= 0 || c.LoadMessageRate <= 0 {
		errs = append(errs, errors.New("load-connections and load-message-rate must be positive"))
	}
	if c.MaxConnections <= 0 {
		errs = append(errs, errors.New("max-connections must be positive"))
	}
	if c.MaxClientIDLength <= 0 || c.MaxClientIDLength > 65535 {
		errs = append(errs, errors.New("max-client-id-length must be in 1..65535"))
	}
	if c.MaxMessageExpiry <= 0 {
		errs = append(errs, errors.New("max-message-expiry must be positive"))
	}
	if c.PublishRate < 0 {
		errs = append(errs, errors.New("publish-rate must not be negative"))
	}
	return errors.Join(errs...)
}

// DefaultConfig returns a config with every default applied.
func DefaultConfig() Config {
	var c Config
	c.RegisterFlags(flag.NewFlagSet("defaults", flag.ContinueOnError), "")
	return c
}

type u16Value struct{ p *uint16 }

func (v u16Value) String() string {
	if v.p == nil {
		return "0"
	}
	return fmt.Sprint(*v.p)
}
func (v u16Value) Set(s string) error {
	var n uint64
	if _, err := fmt.Sscan(s, &n); err != nil || n > math.MaxUint16 {
		return fmt.Errorf("want an integer in 0..65535, got %q", s)
	}
	*v.p = uint16(n)
	return nil
}

type u32Value struct{ p *uint32 }

func (v u32Value) String() string {
	if v.p == nil {
		return "0"
	}
	return fmt.Sprint(*v.p)
}
func (v u32Value) Set(s string) error {
	var n uint64
	if _, err := fmt.Sscan(s, &n); err != nil || n > math.MaxUint32 {
		return fmt.Errorf("want an integer in 0..4294967295, got %q", s)
	}
	*v.p = uint32(n)
	return nil
}

func u16(fs *flag.FlagSet, p *uint16, name string, def uint16, usage string) {
	*p = def
	fs.Var(u16Value{p}, name, usage)
}

func u32(fs *flag.FlagSet, p *uint32, name string, def uint32, usage string) {
	*p = def
	fs.Var(u32Value{p}, name, usage)
}
