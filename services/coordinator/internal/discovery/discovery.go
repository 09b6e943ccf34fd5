// Package discovery finds the other coordinators (and any Keel process that
// gossips) with hashicorp/memberlist. Each member advertises its role, ID,
// Raft address and Connect API address in its node metadata.
//
// Gossip is never a fence: it only tells the coordinators whom to bootstrap
// with and which voters to add. Liveness of edges and writers is decided by
// leases (package lease).
package discovery

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"net"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/keelmq/keel/libs/config"
	"github.com/keelmq/keel/libs/logging"
)

// RoleCoordinator is the role coordinators advertise.
const RoleCoordinator = "coordinator"

// Defaults of [Config].
const (
	DefaultBindAddr     = ":7946"
	DefaultJoinInterval = 2 * time.Second
)

// Config configures [Discovery].
type Config struct {
	BindAddr      string            `yaml:"bind_addr"`
	AdvertiseAddr string            `yaml:"advertise_addr"`
	Join          config.StringList `yaml:"join"`
	JoinInterval  time.Duration     `yaml:"join_interval"`

	// Local selects memberlist's loopback timings (tests).
	Local bool `yaml:"-"`
}

// RegisterFlags registers the flags of c under prefix (e.g. "gossip.").
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.StringVar(&c.BindAddr, prefix+"bind-addr", DefaultBindAddr, "memberlist gossip listen address (TCP and UDP)")
	fs.StringVar(&c.AdvertiseAddr, prefix+"advertise-addr", "", "gossip address peers use (default: derived from the bind address)")
	fs.Var(&c.Join, prefix+"join", "addresses to join, comma-separated or repeated; DNS names resolving to several addresses (a headless service) join them all")
	fs.DurationVar(&c.JoinInterval, prefix+"join-interval", DefaultJoinInterval, "retry interval while no join address answers")
}

// Validate checks c.
func (c *Config) Validate() error {
	if _, _, err := net.SplitHostPort(c.BindAddr); err != nil {
		return fmt.Errorf("gossip bind address %q: %w", c.BindAddr, err)
	}
	if c.JoinInterval <= 0 {
		return errors.New("gossip join interval must be positive")
	}
	return nil
}

// Meta is what a member advertises.
type Meta struct {
	Role     string `json:"r"`
	ID       string `json:"id"`
	RaftAddr string `json:"raft,omitempty"`
	APIAddr  string `json:"api,omitempty"`
	// Commands is the newest Raft command type the node applies (0 from a
	// version before it was advertised): a leader proposes a newer type
	// only once every voter applies it.
	Commands int `json:"cmds,omitempty"`
}

// Member is one live member.
type Member struct {
	Name string
	Meta Meta
}

// Discovery runs memberlist. Build it with [New], then [Discovery.Start].
type Discovery struct {
	cfg    Config
	self   Meta
	logger *slog.Logger

	ml      *memberlist.Memberlist
	changed chan struct{} // one-slot notification

	cancel context.CancelFunc
	wg     sync.WaitGroup

	stopOnce sync.Once
	stopErr  error

	// members is kept from memberlist's events, which run under its lock:
	// the *Node values memberlist.Members returns are its live state, and
	// reading their Meta outside that lock races with gossip updates.
	membersMu sync.Mutex
	members   map[string]Member // by node name; guarded by membersMu
}

// New validates cfg; it starts nothing.
func New(cfg Config, self Meta, logger *slog.Logger) (*Discovery, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if self.ID == "" || self.Role == "" {
		return nil, errors.New("discovery: member id and role are required")
	}
	b, err := json.Marshal(self)
	if err != nil || len(b) > memberlist.MetaMaxSize {
		return nil, fmt.Errorf("discovery: member metadata too large (%d bytes)", len(b))
	}
	if logger == nil {
		logger = logging.Discard()
	}
	return &Discovery{cfg: cfg, self: self, logger: logger.With(logging.KeyComponent, "gossip"), changed: make(chan struct{}, 1),
		members: map[string]Member{}}, nil
}

// Start creates the memberlist and, if join addresses are set, keeps trying
// to join them in the background until one answers.
func (d *Discovery) Start() error {
	var mc *memberlist.Config
	if d.cfg.Local {
		mc = memberlist.DefaultLocalConfig()
	} else {
		mc = memberlist.DefaultLANConfig()
	}
	host, port, _ := net.SplitHostPort(d.cfg.BindAddr)
	if host == "" {
		host = "0.0.0.0"
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return fmt.Errorf("gossip bind port: %w", err)
	}
	mc.Name = d.self.ID
	mc.BindAddr, mc.BindPort = host, p
	mc.AdvertisePort = p
	if d.cfg.AdvertiseAddr != "" {
		ah, ap, err := net.SplitHostPort(d.cfg.AdvertiseAddr)
		if err != nil {
			return fmt.Errorf("gossip advertise address: %w", err)
		}
		mc.AdvertiseAddr = ah
		if mc.AdvertisePort, err = strconv.Atoi(ap); err != nil {
			return fmt.Errorf("gossip advertise port: %w", err)
		}
	}
	mc.Delegate = delegate{d}
	mc.Events = events{d}
	mc.Logger = log.New(&logWriter{d.logger}, "", 0)
	ml, err := memberlist.Create(mc)
	if err != nil {
		return fmt.Errorf("start memberlist: %w", err)
	}
	d.ml = ml
	ctx, cancel := context.WithCancel(context.Background())
	d.cancel = cancel
	if len(d.cfg.Join) > 0 {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			d.joinLoop(ctx)
		}()
	}
	d.logger.Info("gossip started", "addr", d.Addr())
	return nil
}

func (d *Discovery) joinLoop(ctx context.Context) {
	for {
		n, err := d.ml.Join(d.cfg.Join)
		if n > 0 {
			d.logger.Info("joined gossip", "contacted", n)
			return
		}
		d.logger.Warn("gossip join failed, retrying", logging.Err(err), "join", []string(d.cfg.Join))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d.cfg.JoinInterval):
		}
	}
}

// Addr returns the gossip address others can join, host:port.
func (d *Discovery) Addr() string {
	n := d.ml.LocalNode()
	return net.JoinHostPort(n.Addr.String(), strconv.Itoa(int(n.Port)))
}

// Changed returns a channel that receives after membership changed.
func (d *Discovery) Changed() <-chan struct{} { return d.changed }

func (d *Discovery) notify() {
	select {
	case d.changed <- struct{}{}:
	default:
	}
}

// Members returns the live members with valid metadata, sorted by ID.
func (d *Discovery) Members() []Member {
	d.membersMu.Lock()
	out := make([]Member, 0, len(d.members))
	for _, m := range d.members {
		out = append(out, m)
	}
	d.membersMu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Meta.ID < out[j].Meta.ID })
	return out
}

// update records n (called from memberlist's events, under its lock).
func (d *Discovery) update(n *memberlist.Node, alive bool) {
	var m Meta
	valid := alive && json.Unmarshal(n.Meta, &m) == nil && m.ID != ""
	d.membersMu.Lock()
	if valid {
		d.members[n.Name] = Member{Name: n.Name, Meta: m}
	} else {
		delete(d.members, n.Name)
	}
	d.membersMu.Unlock()
	d.notify()
}

// Coordinators returns the live coordinators, this one included, sorted by ID.
func (d *Discovery) Coordinators() []Member {
	var out []Member
	for _, m := range d.Members() {
		if m.Meta.Role == RoleCoordinator {
			out = append(out, m)
		}
	}
	return out
}

// Stop leaves the cluster (so peers see a graceful departure rather than a
// failure) and shuts memberlist down. Safe to call more than once.
func (d *Discovery) Stop(timeout time.Duration) error {
	if d.ml == nil {
		return nil
	}
	// memberlist panics on Leave after Shutdown, so only the first call acts.
	d.stopOnce.Do(func() {
		d.cancel()
		d.wg.Wait()
		var errs []error
		if err := d.ml.Leave(timeout); err != nil {
			errs = append(errs, fmt.Errorf("leave gossip: %w", err))
		}
		if err := d.ml.Shutdown(); err != nil {
			errs = append(errs, fmt.Errorf("stop gossip: %w", err))
		}
		d.stopErr = errors.Join(errs...)
	})
	return d.stopErr
}

type delegate struct{ d *Discovery }

func (g delegate) NodeMeta(int) []byte {
	b, _ := json.Marshal(g.d.self)
	return b
}
func (delegate) NotifyMsg([]byte)                {}
func (delegate) GetBroadcasts(int, int) [][]byte { return nil }
func (delegate) LocalState(bool) []byte          { return nil }
func (delegate) MergeRemoteState([]byte, bool)   {}

type events struct{ d *Discovery }

func (e events) NotifyJoin(n *memberlist.Node)   { e.d.update(n, true) }
func (e events) NotifyLeave(n *memberlist.Node)  { e.d.update(n, false) }
func (e events) NotifyUpdate(n *memberlist.Node) { e.d.update(n, true) }

// logWriter maps memberlist's "[LEVEL] memberlist: ..." lines onto slog.
type logWriter struct{ l *slog.Logger }

func (w *logWriter) Write(p []byte) (int, error) {
	lvl := slog.LevelDebug
	switch {
	case bytes.Contains(p, []byte("[ERR]")):
		lvl = slog.LevelError
	case bytes.Contains(p, []byte("[WARN]")):
		lvl = slog.LevelWarn
	}
	if w.l.Enabled(context.Background(), lvl) {
		w.l.Log(context.Background(), lvl, "memberlist", "line", string(bytes.TrimSpace(p)))
	}
	return len(p), nil
}
