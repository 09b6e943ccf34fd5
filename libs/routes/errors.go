package routes

import "errors"

// ErrInvalidTenant reports a tenant name outside [a-z0-9-]{1,63}.
var ErrInvalidTenant = errors.New("routes: invalid tenant")

// ErrInvalidGroup reports a share group that is not a valid share name.
var ErrInvalidGroup = errors.New("routes: invalid share group")

// ErrInvalidBloom reports Bloom filter parameters that do not describe a filter.
var ErrInvalidBloom = errors.New("routes: invalid bloom filter")
