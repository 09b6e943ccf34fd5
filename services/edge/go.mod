module github.com/keelmq/keel/services/edge

go 1.26.0

require (
	github.com/gorilla/websocket v1.5.0 // indirect
	github.com/mochi-mqtt/server/v2 v2.7.9 // indirect
	github.com/prometheus/client_golang v1.25.0 // indirect
	github.com/rs/xid v1.4.0 // indirect
	github.com/stretchr/testify v1.11.1 // indirect
	go.etcd.io/bbolt v1.4.3 // indirect
	go.yaml.in/yaml/v3 v3.0.6 // indirect
	golang.org/x/crypto v0.59.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
