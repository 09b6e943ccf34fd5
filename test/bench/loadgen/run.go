package loadgen

import (
	"context"
	"math/rand/v2"
)

// Run validates cfg and runs its scenario. A non-nil Result may still carry
// connection errors in Result.Errors; an error means there is no result.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	runID := rand.Uint32()
	switch cfg.Scenario {
	case ScenarioStorm, ScenarioIdle:
		return runStorm(ctx, &cfg, runID)
	case ScenarioFailover:
		return runFailover(ctx, &cfg, runID)
	default:
		return runFlow(ctx, &cfg, runID)
	}
}
