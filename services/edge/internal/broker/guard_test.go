package broker

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
	"github.com/stretchr/testify/require"

	"github.com/keelmq/keel/services/edge/internal/mqtttest"

	"github.com/keelmq/keel/services/edge/internal/auth"
)

type passwordAuth string

func (p passwordAuth) Authenticate(_ context.Context, r *auth.Request) (*auth.Identity, error) {
	if string(r.Password) != string(p) {
		return nil, auth.ErrBadCredentials
	}
	return &auth.Identity{Tenant: "default", Username: r.Username}, nil
}

func startWith(t *testing.T, authn auth.Authenticator, mutate func(*Config)) string {
	t.Helper()
	cfg := DefaultConfig()
	mutate(&cfg)
	b, err := New(cfg, authn, nil, nil)
	require.NoError(t, err)
	addr := serveTCP(t, b)
	t.Cleanup(func() { _ = b.Close() })
	return addr
}

func connectWith(t *testing.T, addr, user, password string) byte {
	t.Helper()
	return connectFrom(t, nil, addr, user, password)
}

// connectFrom is connectWith from the local address from (nil: any).
func connectFrom(t *testing.T, from net.Addr, addr, user, password string) byte {
	t.Helper()
	c := mqtttest.DialFrom(t, from, addr, 5)
	c.Send(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Connect}, Connect: packets.ConnectParams{
		ProtocolName: []byte("MQTT"), Clean: true, Keepalive: 30, ClientIdentifier: "c",
		UsernameFlag: true, Username: []byte(user), PasswordFlag: true, Password: []byte(password)}})
	return c.Expect(packets.Connack).ReasonCode
}

// Repeated failures ban the client's address: even the right password is
// refused with 0x8A until the ban ends.
func TestGuard_BansAfterRepeatedFailures(t *testing.T) {
	t.Parallel()
	addr := startWith(t, passwordAuth("right"), func(c *Config) {
		c.AuthMaxFailures, c.AuthFailureWindow, c.AuthBanDuration = 3, time.Minute, 400*time.Millisecond
	})
	for range 3 {
		require.Equal(t, packets.ErrBadUsernameOrPassword.Code, connectWith(t, addr, "u", "wrong"))
	}
	require.Equal(t, packets.ErrBanned.Code, connectWith(t, addr, "u", "right"))
	require.Eventually(t, func() bool { return connectWith(t, addr, "u", "right") == packets.CodeSuccess.Code },
		5*time.Second, 100*time.Millisecond, "the ban ends")
}

func TestGuard_ConnectRatePerListener(t *testing.T) {
	t.Parallel()
	addr := startWith(t, passwordAuth("p"), func(c *Config) { c.ConnectRate, c.ConnectBurst = 0.5, 2 })
	require.Equal(t, packets.CodeSuccess.Code, connectWith(t, addr, "u", "p"))
	require.Equal(t, packets.CodeSuccess.Code, connectWith(t, addr, "u", "p"))
	require.Equal(t, packets.ErrConnectionRateExceeded.Code, connectWith(t, addr, "u", "p"))
}

// A ban is of the address that failed, not of the user name it gave: an
// address guessing a device's password does not lock the device out.
func TestGuard_BansTheAddressNotTheUserName(t *testing.T) {
	t.Parallel()
	addr := startWith(t, passwordAuth("right"), func(c *Config) {
		c.AuthMaxFailures, c.AuthFailureWindow, c.AuthBanDuration = 3, time.Minute, time.Minute
	})
	attacker := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}
	for range 3 {
		require.Equal(t, packets.ErrBadUsernameOrPassword.Code, connectFrom(t, attacker, addr, "sensor-17", "guess"))
	}
	require.Equal(t, packets.ErrBanned.Code, connectFrom(t, attacker, addr, "sensor-17", "right"), "the address is banned")
	require.Equal(t, packets.CodeSuccess.Code, connectFrom(t, nil, addr, "sensor-17", "right"), "the device, from its own address, is not")
}
