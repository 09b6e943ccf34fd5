package auth

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
)

// ACLSource is a backend that can read the ACLs of its users again, so that
// connected clients follow changes (see [Identity.ACLSource]).
type ACLSource interface {
	// ReadACLs returns the ACL now in force for each of users (as
	// [Identity.ACLUser] names them) of tenant. A user missing from the
	// result no longer exists or is disabled; one mapped to nil may use
	// every topic of its tenant. An error means nothing could be read (the
	// caller keeps what it has and tries again later).
	ReadACLs(ctx context.Context, tenant string, users []string) (map[string]*ACL, error)
}

// ACLInvalidator is a backend that caches users or ACLs. InvalidateACLs
// makes it answer from the source of truth for the given tenants from now
// on (the empty tenant stands for every tenant): after an ACL version bump
// from the coordinator, a new connection of the tenant is checked against
// current data, not against what was cached before the change.
type ACLInvalidator interface {
	InvalidateACLs(tenants []string) error
}

// InvalidateACLs implements [ACLInvalidator] by invalidating every member
// that caches.
func (c Chain) InvalidateACLs(tenants []string) error {
	var errs []error
	for _, a := range c {
		if inv, ok := a.(ACLInvalidator); ok {
			errs = append(errs, inv.InvalidateACLs(tenants))
		}
	}
	return errors.Join(errs...)
}

// InvalidateACLs implements [ACLInvalidator] for the password backend.
func (a CertAuthenticator) InvalidateACLs(tenants []string) error {
	if inv, ok := a.Password.(ACLInvalidator); ok {
		return inv.InvalidateACLs(tenants)
	}
	return nil
}

// InvalidateACLs implements [ACLInvalidator]: the file is read again (the
// whole file; it is the one source for every tenant). A file that fails to
// load leaves the last good one in force, and the error is returned.
func (f *FileAuthenticator) InvalidateACLs([]string) error { return f.Reload() }

// ReadACLs implements [ACLSource] from the file as last loaded.
func (f *FileAuthenticator) ReadACLs(_ context.Context, tenant string, users []string) (map[string]*ACL, error) {
	s := f.state.Load()
	out := make(map[string]*ACL, len(users))
	for _, u := range users {
		if rec := s.byQualified[u+"@"+tenant]; rec != nil {
			out[u] = rec.acl
		}
	}
	return out, nil
}

// InvalidateACLs implements [ACLInvalidator]: the cached answers about the
// tenants' users are dropped, and every cached "no such user" as well (a
// bare user name may have just appeared in one of them).
func (a *PostgresAuthenticator) InvalidateACLs(tenants []string) error {
	all := slices.Contains(tenants, "")
	a.mu.Lock()
	defer a.mu.Unlock()
	for k, e := range a.cache {
		if all || !e.found || slices.Contains(tenants, e.identity.Tenant) {
			delete(a.cache, k)
		}
	}
	return nil
}

// ReadACLs implements [ACLSource] with one query for all of users.
func (a *PostgresAuthenticator) ReadACLs(ctx context.Context, tenant string, users []string) (map[string]*ACL, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.QueryTimeout)
	defer cancel()
	const q = `SELECT u.username, COALESCE(u.acl, t.acl)
	             FROM keel_users u JOIN keel_tenants t ON t.name = u.tenant
	            WHERE u.tenant = $1 AND u.username = ANY($2) AND NOT u.disabled`
	rows, err := a.pool.Query(ctx, q, tenant, users)
	if err != nil {
		return nil, a.unavailable(err)
	}
	defer rows.Close()
	out := make(map[string]*ACL, len(users))
	for rows.Next() {
		var user string
		var raw []byte
		if err := rows.Scan(&user, &raw); err != nil {
			return nil, a.unavailable(err)
		}
		var acl *ACL
		if len(raw) > 0 {
			acl = &ACL{}
			if err := json.Unmarshal(raw, acl); err != nil {
				// The user cannot connect with this ACL either (lookup
				// refuses it): treated as gone.
				if a.logger != nil {
					a.logger.Warn("user acl unreadable", "tenant", tenant, "user", user, "error", err)
				}
				continue
			}
		}
		out[user] = acl
	}
	if err := rows.Err(); err != nil {
		return nil, a.unavailable(err)
	}
	return out, nil
}

var (
	_ ACLSource      = (*FileAuthenticator)(nil)
	_ ACLSource      = (*PostgresAuthenticator)(nil)
	_ ACLInvalidator = (*FileAuthenticator)(nil)
	_ ACLInvalidator = (*PostgresAuthenticator)(nil)
	_ ACLInvalidator = Chain(nil)
	_ ACLInvalidator = CertAuthenticator{}
)
