package testutil

import (
	"net"
	"strconv"
	"sync"
	"testing"
)

var (
	portsMu sync.Mutex
	ports   = map[int]bool{} // ports handed out by this process; guarded by portsMu
)

// FreePort returns a TCP port on 127.0.0.1 that was free when it was chosen.
// Another process may still take it before the caller binds, so prefer
// binding to "127.0.0.1:0" and reading the address back where the code under
// test allows it. A port is never returned twice within one test binary, so
// parallel tests do not collide with each other.
func FreePort(t testing.TB) int {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("find free port: %v", err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		if err := ln.Close(); err != nil {
			t.Fatalf("find free port: %v", err)
		}
		if !ports[port] {
			ports[port] = true
			return port
		}
	}
	t.Fatalf("find free port: no unused port after 100 tries")
	return 0
}

// FreeAddr returns "127.0.0.1:<port>" for a port from [FreePort].
func FreeAddr(t testing.TB) string {
	t.Helper()
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(FreePort(t)))
}
