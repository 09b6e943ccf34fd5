package auth

import (
	"context"
	"fmt"
	"strings"
)

// CertAuthenticator admits clients by the certificate they presented on a
// TLS listener that verified it against the client CA.
type CertAuthenticator struct {
	// IdentityFrom selects the user name: "cn" (default), "san-dns",
	// "san-email" or "san-uri" (the first of that kind).
	IdentityFrom string
	// TenantFrom selects the tenant: "ou" (default), "o", or "fixed:<tenant>".
	TenantFrom string
	// Password, when set, must also admit the client ("certificate and
	// password"); the tenant of both must agree.
	Password Authenticator
}

// Authenticate implements [Authenticator].
func (a CertAuthenticator) Authenticate(ctx context.Context, req *Request) (*Identity, error) {
	if req.TLS == nil || len(req.TLS.VerifiedChains) == 0 || len(req.TLS.VerifiedChains[0]) == 0 {
		return nil, ErrBadCredentials // no verified client certificate on this connection
	}
	leaf := req.TLS.VerifiedChains[0][0]
	var user string
	switch a.IdentityFrom {
	case "", "cn":
		user = leaf.Subject.CommonName
	case "san-dns":
		user = first(leaf.DNSNames)
	case "san-email":
		user = first(leaf.EmailAddresses)
	case "san-uri":
		if len(leaf.URIs) > 0 {
			user = leaf.URIs[0].String()
		}
	default:
		return nil, fmt.Errorf("%w: unknown identity field %q", ErrUnavailable, a.IdentityFrom)
	}
	var tenant string
	switch {
	case a.TenantFrom == "" || a.TenantFrom == "ou":
		tenant = first(leaf.Subject.OrganizationalUnit)
	case a.TenantFrom == "o":
		tenant = first(leaf.Subject.Organization)
	case strings.HasPrefix(a.TenantFrom, "fixed:"):
		tenant = strings.TrimPrefix(a.TenantFrom, "fixed:")
	default:
		return nil, fmt.Errorf("%w: unknown tenant field %q", ErrUnavailable, a.TenantFrom)
	}
	if user == "" || tenant == "" {
		return nil, fmt.Errorf("%w: certificate lacks the identity or tenant field", ErrNotAuthorized)
	}
	id := &Identity{Tenant: tenant, Username: user, ExpiresAt: leaf.NotAfter}
	if a.Password != nil {
		pid, err := a.Password.Authenticate(ctx, req)
		if err != nil {
			return nil, err
		}
		if pid.Tenant != tenant {
			return nil, fmt.Errorf("%w: certificate tenant %q, password tenant %q", ErrNotAuthorized, tenant, pid.Tenant)
		}
		id.ACL, id.ACLSource, id.ACLUser = pid.ACL, pid.ACLSource, pid.ACLUser
	}
	return id, nil
}

func first(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}
