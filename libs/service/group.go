package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/keelmq/keel/libs/logging"
)

// DefaultStopTimeout is the per-component stop deadline [Group.Run] uses
// when given a stopTimeout of zero or less.
const DefaultStopTimeout = 10 * time.Second

// Group starts components in the order they were added and stops them in
// the reverse order. The zero value is ready to use; add every component
// before calling [Group.Run], which may be called once.
//
// Each component's stop function is called at most once, and only if its
// start succeeded.
type Group struct {
	components []*component
	ran        atomic.Bool
}

type component struct {
	name  string
	start func(context.Context) error
	stop  func(context.Context) error
	run   func(context.Context) error

	// Set by Run for components added with AddRun.
	cancel context.CancelFunc
	done   chan struct{} // closed when run returns
	err    error         // run's result; read only after done is closed
}

// Add adds a component with a start/stop pair. Either may be nil; a
// stop-only component is the place for a shutdown step such as failing
// /readyz and waiting out a drain period.
//
// start must return once the component is started. Its context is the one
// given to Run, so it is canceled as soon as shutdown is requested: use it to
// abandon a slow start, not as the component's lifetime. stop gets a context
// with the per-step deadline.
func (g *Group) Add(name string, start, stop func(ctx context.Context) error) {
	g.components = append(g.components, &component{name: name, start: start, stop: stop})
}

// AddRun adds a component whose run function blocks until its context is
// canceled, the Run(ctx) error shape. Run calls it in a goroutine in this
// component's start turn and cancels its context in its stop turn, then waits
// for it to return within the stop deadline. If run returns before shutdown,
// the group shuts down and Run returns run's error, or [ErrExited] if it was
// nil. An exit during startup is noticed between starts, so the components
// after it may or may not be started (and then stopped) first. An error wrapping [context.Canceled] returned after the cancel counts
// as a clean stop.
func (g *Group) AddRun(name string, run func(ctx context.Context) error) {
	g.components = append(g.components, &component{name: name, run: run})
}

// Run starts the components in order, waits until ctx is done or a
// component added with [Group.AddRun] exits, then stops the started
// components in reverse order, each within stopTimeout (or
// [DefaultStopTimeout] if stopTimeout <= 0). If a start fails, the components
// already started are stopped the same way.
//
// A stop that overruns its deadline is abandoned, its goroutine left behind,
// so that one stuck component cannot hang the shutdown of the others.
//
// Run returns the first error: a failed start or an early exit, or else the
// first failed stop. Cancellation of ctx is a normal shutdown, not an error.
// A nil logger discards.
func (g *Group) Run(ctx context.Context, stopTimeout time.Duration, logger *slog.Logger) error {
	if !g.ran.CompareAndSwap(false, true) {
		return ErrAlreadyRun
	}
	if logger == nil {
		logger = logging.Discard()
	}
	if stopTimeout <= 0 {
		stopTimeout = DefaultStopTimeout
	}

	// exited receives each AddRun component when its run returns; buffered so
	// the run goroutines never block on it.
	exited := make(chan *component, len(g.components))
	var (
		firstErr error
		trigger  *component // the AddRun component whose exit caused shutdown
		started  int
	)
	exitErr := func(c *component) error {
		if c.err != nil {
			return fmt.Errorf("run %s: %w", c.name, c.err)
		}
		return fmt.Errorf("run %s: %w", c.name, ErrExited)
	}

startLoop:
	for _, c := range g.components {
		select {
		case <-ctx.Done():
			logger.Info("shutdown requested during startup", logging.KeyReason, context.Cause(ctx).Error())
			break startLoop
		case c := <-exited:
			trigger, firstErr = c, exitErr(c)
			logger.Error("component exited during startup", logging.KeyComponent, c.name, logging.Err(firstErr))
			break startLoop
		default:
		}

		logger.Info("starting component", logging.KeyComponent, c.name)
		begin := time.Now()
		switch {
		case c.run != nil:
			var rctx context.Context
			rctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))
			c.done = make(chan struct{})
			go func() {
				defer func() { exited <- c }()
				defer close(c.done)
				c.err = c.run(rctx)
			}()
		case c.start != nil:
			if err := c.start(ctx); err != nil {
				firstErr = fmt.Errorf("start %s: %w", c.name, err)
				logger.Error("component start failed", logging.KeyComponent, c.name, logging.Err(err))
				break startLoop
			}
		}
		started++
		logger.Debug("component started", logging.KeyComponent, c.name, "duration", time.Since(begin))
	}

	if firstErr == nil && started == len(g.components) && ctx.Err() == nil {
		logger.Info("all components started", "count", started)
		select {
		case <-ctx.Done():
			logger.Info("shutdown requested", logging.KeyReason, context.Cause(ctx).Error())
		case c := <-exited:
			trigger, firstErr = c, exitErr(c)
			logger.Error("component exited", logging.KeyComponent, c.name, logging.Err(firstErr))
		}
	}

	for i := started - 1; i >= 0; i-- {
		c := g.components[i]
		if c.stop == nil && c.run == nil {
			continue
		}
		logger.Info("stopping component", logging.KeyComponent, c.name)
		begin := time.Now()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
		err := stopComponent(sctx, c, c == trigger)
		cancel()
		if err != nil {
			logger.Error("component stop failed", logging.KeyComponent, c.name, logging.Err(err), "duration", time.Since(begin))
			if firstErr == nil {
				firstErr = fmt.Errorf("stop %s: %w", c.name, err)
			}
			continue
		}
		logger.Info("component stopped", logging.KeyComponent, c.name, "duration", time.Since(begin))
	}
	return firstErr
}

// stopComponent stops c within ctx's deadline. For an AddRun component that
// triggered the shutdown, its exit error was already reported.
func stopComponent(ctx context.Context, c *component, triggered bool) error {
	if c.run != nil {
		c.cancel()
		select {
		case <-c.done:
			if triggered || errors.Is(c.err, context.Canceled) {
				return nil
			}
			return c.err
		case <-ctx.Done():
			return fmt.Errorf("still running: %w", context.Cause(ctx))
		}
	}

	result := make(chan error, 1)
	go func() { result <- c.stop(ctx) }()
	select {
	case err := <-result:
		return err
	case <-ctx.Done():
		// NOTE: the stop goroutine is abandoned here. Waiting for it would let
		// one stuck component hang the process forever; the process is on its
		// way out, which ends it.
		return fmt.Errorf("abandoned: %w", context.Cause(ctx))
	}
}
