package server

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/keelmq/keel/libs/logging"
	"github.com/keelmq/keel/services/router/internal/store"
)

// memStore is a one-member in-memory [Store]: the router logic without Olric,
// for unit and fuzz tests.
type memStore struct {
	mu sync.Mutex
	m  map[string][]byte
}

func newMemStore() *memStore { return &memStore{m: map[string][]byte{}} }

func (s *memStore) Name() string                               { return "mem-0" }
func (s *memStore) Members(context.Context) ([]string, uint64) { return []string{"mem-0"}, 1 }

func (s *memStore) Get(_ context.Context, key string) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.m[key]
	if !ok {
		return nil, store.ErrNotFound
	}
	return slices.Clone(v), nil
}

func (s *memStore) Put(_ context.Context, key string, value []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[key] = slices.Clone(value)
	return nil
}

func (s *memStore) Delete(_ context.Context, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, key)
	return nil
}

func (s *memStore) Scan(_ context.Context, prefix string, fn func(string) bool) error {
	s.mu.Lock()
	var keys []string
	for k := range s.m {
		if strings.HasPrefix(k, prefix) {
			keys = append(keys, k)
		}
	}
	s.mu.Unlock()
	slices.Sort(keys)
	for _, k := range keys {
		if !fn(k) {
			break
		}
	}
	return nil
}

func (s *memStore) keys(prefix string) []string {
	var out []string
	_ = s.Scan(context.Background(), prefix, func(k string) bool { out = append(out, k); return true })
	return out
}

// newMemNode returns a node over a fresh memStore, its replicas loaded.
func newMemNode(t testing.TB) (*Node, *memStore) {
	t.Helper()
	st := newMemStore()
	n, err := New(Config{AdvertiseURL: "http://127.0.0.1:1"}, st, nil, logging.Discard())
	if err != nil {
		t.Fatal(err)
	}
	n.members, n.view = st.Members(context.Background())
	if err := n.reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	n.loaded.Store(true)
	return n, st
}
