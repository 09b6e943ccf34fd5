package server

import "net/http"

// H2CTransport returns a client transport that speaks HTTP/2 without TLS
// (prior knowledge), which gRPC bidirectional streams need between router
// nodes and from edges on a private network.
func H2CTransport() *http.Transport {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Transport{Protocols: &p, ForceAttemptHTTP2: true}
}

func h2cTransport() *http.Transport { return H2CTransport() }

// ServerProtocols returns the protocols an API server should accept: HTTP/1.1
// and unencrypted HTTP/2.
func ServerProtocols() *http.Protocols {
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	return &p
}
