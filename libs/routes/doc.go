// Package routes holds what the edge-side routing client and the router must
// agree on byte for byte: the identity of a route ([Key]), the order-independent
// [Digest] of a route set, the per-tenant anchor [Bloom] filter, and the
// validation of routes coming from outside ([Validate]).
package routes
