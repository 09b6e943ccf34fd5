package redisstore

import (
	"testing"

	"github.com/keelmq/keel/libs/testutil"
	"github.com/keelmq/keel/services/persistence/internal/redistest"
	"github.com/keelmq/keel/services/persistence/internal/store"
	"github.com/keelmq/keel/services/persistence/internal/store/storetest"
)

// The contract runs against a real group: a primary with two replicas,
// min-replicas-to-write 1, every write confirmed by WAIT 1.
func TestRedisStore_Contract(t *testing.T) {
	if testing.Short() {
		t.Skip("redis: skipped under -short")
	}
	g := redistest.StartGroup(t, 2, 1)
	n := 0
	storetest.Run(t, func(t *testing.T) store.Store {
		n++
		// A fresh database per subtest on the same group.
		c := g.Primary.Client()
		if err := c.FlushAll(t.Context()).Err(); err != nil {
			t.Fatal(err)
		}
		s, err := New(Config{Addr: g.Primary.Addr, MinReplicas: 1}, testutil.Logger(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		return s
	})
}
