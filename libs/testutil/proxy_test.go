package testutil

import (
	"bufio"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

func TestProxy_CarriesUntilStalled(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() { // echoes lines
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	p := NewProxy(t, ln.Addr().String())
	dial := func() (net.Conn, *bufio.Reader) {
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c, bufio.NewReader(c)
	}
	echoes := func(c net.Conn, r *bufio.Reader, line string) bool {
		if _, err := c.Write([]byte(line)); err != nil {
			return false
		}
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		got, err := r.ReadString('\n')
		return err == nil && got == line
	}

	before, beforeR := dial()
	if !echoes(before, beforeR, "one\n") {
		t.Fatal("not carried before the stall")
	}
	p.Stall()
	if echoes(before, beforeR, "two\n") {
		t.Fatal("carried after the stall")
	}
	after, afterR := dial()
	if !echoes(after, afterR, "three\n") {
		t.Fatal("a connection made after the stall is not carried")
	}

	p.Cut()
	_ = after.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := afterR.ReadString('\n'); !errors.Is(err, io.EOF) {
		t.Fatalf("a connection carried at the cut is not closed: %v", err)
	}
	cut, cutR := dial() // the proxy accepts, then closes
	if echoes(cut, cutR, "four\n") {
		t.Fatal("a connection made after the cut is carried")
	}
}
