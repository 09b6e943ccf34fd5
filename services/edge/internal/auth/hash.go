package auth

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/crypto/argon2"
	"golang.org/x/crypto/bcrypt"
)

var errMismatch = errors.New("password mismatch")

var randRead = rand.Read

type passwordHash interface {
	verify(pw []byte) error
}

type bcryptHash []byte

func (h bcryptHash) verify(pw []byte) error {
	err := bcrypt.CompareHashAndPassword(h, pw)
	if errors.Is(err, bcrypt.ErrMismatchedHashAndPassword) {
		return errMismatch
	}
	return err
}

type argon2idHash struct {
	memory  uint32
	time    uint32
	threads uint8
	salt    []byte
	key     []byte
}

func (h argon2idHash) verify(pw []byte) error {
	k := argon2.IDKey(pw, h.salt, h.time, h.memory, h.threads, uint32(len(h.key)))
	if subtle.ConstantTimeCompare(k, h.key) != 1 {
		return errMismatch
	}
	return nil
}

// parseHash accepts bcrypt ($2a$, $2b$, $2y$) and argon2id PHC strings
// ($argon2id$v=19$m=65536,t=3,p=2$<salt>$<key>, unpadded base64).
func parseHash(s string) (passwordHash, error) {
	switch {
	case strings.HasPrefix(s, "$2a$"), strings.HasPrefix(s, "$2b$"), strings.HasPrefix(s, "$2y$"):
		if _, err := bcrypt.Cost([]byte(s)); err != nil {
			return nil, fmt.Errorf("bcrypt hash: %w", err)
		}
		return bcryptHash(s), nil
	case strings.HasPrefix(s, "$argon2id$"):
		parts := strings.Split(s, "$")
		if len(parts) != 6 || parts[2] != "v=19" {
			return nil, errors.New("argon2id hash: want $argon2id$v=19$m=..,t=..,p=..$salt$key")
		}
		var h argon2idHash
		for _, kv := range strings.Split(parts[3], ",") {
			k, v, _ := strings.Cut(kv, "=")
			n, err := strconv.ParseUint(v, 10, 32)
			if err != nil {
				return nil, fmt.Errorf("argon2id hash: parameter %q: %w", kv, err)
			}
			switch k {
			case "m":
				h.memory = uint32(n)
			case "t":
				h.time = uint32(n)
			case "p":
				if n > 255 {
					return nil, errors.New("argon2id hash: p > 255")
				}
				h.threads = uint8(n)
			default:
				return nil, fmt.Errorf("argon2id hash: unknown parameter %q", k)
			}
		}
		if h.memory == 0 || h.time == 0 || h.threads == 0 {
			return nil, errors.New("argon2id hash: m, t and p are required")
		}
		var err error
		if h.salt, err = base64.RawStdEncoding.DecodeString(parts[4]); err != nil {
			return nil, fmt.Errorf("argon2id hash: salt: %w", err)
		}
		if h.key, err = base64.RawStdEncoding.DecodeString(parts[5]); err != nil || len(h.key) < 16 {
			return nil, errors.New("argon2id hash: key must be base64 of at least 16 bytes")
		}
		return h, nil
	case s == "":
		return nil, errors.New("password hash is empty")
	}
	return nil, errors.New("unsupported password hash: want bcrypt or argon2id")
}

// HashArgon2id returns an argon2id PHC string for pw with the parameters
// recommended by RFC 9106 (second choice: m=64 MiB, t=3, p=4).
func HashArgon2id(pw []byte) (string, error) {
	salt := make([]byte, 16)
	if _, err := randRead(salt); err != nil {
		return "", err
	}
	const m, t, p = 64 * 1024, 3, 4
	key := argon2.IDKey(pw, salt, t, m, p, 32)
	return fmt.Sprintf("$argon2id$v=19$m=%d,t=%d,p=%d$%s$%s", m, t, p,
		base64.RawStdEncoding.EncodeToString(salt), base64.RawStdEncoding.EncodeToString(key)), nil
}

// HashBcrypt returns a bcrypt hash of pw at the given cost.
func HashBcrypt(pw []byte, cost int) (string, error) {
	b, err := bcrypt.GenerateFromPassword(pw, cost)
	return string(b), err
}
