package lease

import "github.com/keelmq/keel/libs/rendezvous"

// Custodian picks the custodian of a session among candidate edge IDs by
// rendezvous hashing of tenant + client ID (libs/rendezvous, which draining
// edges use too): every leader picks the same one for the same candidates,
// and when a candidate leaves only its own sessions move. It returns -1 for
// no candidates.
func Custodian(tenant, clientID string, candidates []string) int {
	return rendezvous.Pick(tenant, clientID, candidates)
}
