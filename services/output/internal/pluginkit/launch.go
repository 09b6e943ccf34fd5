package pluginkit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
)

// DefaultStartTimeout bounds the handshake of a launched plugin.
const DefaultStartTimeout = 10 * time.Second

// Process is one running plugin process and its dispensed client.
type Process struct {
	client *plugin.Client
	pid    int
	raw    any
}

// Launch starts the plugin binary at path and dispenses kind ([KindSink] or
// [KindTransform]). On any error after the process started it is killed, so a
// failed Launch leaves nothing running.
func Launch(path, kind string, startTimeout time.Duration, logger *slog.Logger) (*Process, error) {
	if startTimeout <= 0 {
		startTimeout = DefaultStartTimeout
	}
	if err := checkBinary(path); err != nil {
		return nil, err
	}
	cmd := exec.Command(path)
	// NOTE: the plugin gets the host's environment (go-plugin adds the cookie);
	// it may carry secrets referenced from the rules file as ${VAR}.
	client := plugin.NewClient(&plugin.ClientConfig{
		HandshakeConfig:  Handshake,
		Plugins:          PluginSet(),
		Cmd:              cmd,
		AllowedProtocols: []plugin.Protocol{plugin.ProtocolGRPC},
		StartTimeout:     startTimeout,
		Logger:           newHCLogger(logger),
		Managed:          false,
		GRPCDialOptions: []grpc.DialOption{grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(MaxMessageBytes), grpc.MaxCallSendMsgSize(MaxMessageBytes))},
	})
	rpc, err := client.Client()
	if err != nil {
		client.Kill()
		return nil, fmt.Errorf("%w: %s: %w", ErrLaunch, path, err)
	}
	raw, err := rpc.Dispense(kind)
	if err != nil {
		client.Kill()
		return nil, fmt.Errorf("%w: %s does not serve a %s: %w", ErrLaunch, path, kind, err)
	}
	p := &Process{client: client, raw: raw}
	if rc := client.ReattachConfig(); rc != nil {
		p.pid = rc.Pid
	}
	return p, nil
}

func checkBinary(path string) error {
	st, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrLaunch, err)
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return fmt.Errorf("%w: %s is not an executable file", ErrLaunch, path)
	}
	return nil
}

// Sink returns the dispensed sink client, or nil.
func (p *Process) Sink() HostSink { s, _ := p.raw.(HostSink); return s }

// Transform returns the dispensed transform client, or nil.
func (p *Process) Transform() HostTransform { t, _ := p.raw.(HostTransform); return t }

// Pid is the plugin's process ID.
func (p *Process) Pid() int { return p.pid }

// Exited reports whether the process has exited.
func (p *Process) Exited() bool { return p.client.Exited() }

// Kill ends the process. With hard set it is sent SIGKILL first, for a plugin
// that hangs (go-plugin's own Kill asks politely and waits 2 s). Safe to call
// more than once.
func (p *Process) Kill(hard bool) {
	if hard && p.pid > 0 && !p.client.Exited() {
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
	}
	p.client.Kill()
}

// Stop closes the plugin gracefully within ctx, then ends the process.
func (p *Process) Stop(ctx context.Context, closeFn func(context.Context) error) error {
	var err error
	if closeFn != nil && !p.client.Exited() {
		err = closeFn(ctx)
	}
	p.Kill(errors.Is(ctx.Err(), context.DeadlineExceeded))
	return err
}
