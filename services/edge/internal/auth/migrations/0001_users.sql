-- Tenants, users and ACLs for password authentication.
CREATE TABLE IF NOT EXISTS keel_tenants (
    name        text PRIMARY KEY CHECK (name ~ '^[a-z0-9-]{1,63}$'),
    acl         jsonb,            -- default {"publish": [...], "subscribe": [...]} for the tenant's users
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS keel_users (
    tenant        text NOT NULL REFERENCES keel_tenants(name) ON DELETE CASCADE,
    username      text NOT NULL CHECK (username <> '' AND position('@' in username) = 0),
    password_hash text NOT NULL,  -- bcrypt ($2a$/$2b$/$2y$) or argon2id PHC string
    acl           jsonb,          -- overrides the tenant's default when set
    disabled      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, username)
);

CREATE INDEX IF NOT EXISTS keel_users_username ON keel_users (username);
