module github.com/keelmq/keel/test/conformance

go 1.26.0

require (
	github.com/eclipse/paho.golang v0.23.0
	github.com/eclipse/paho.mqtt.golang v1.5.1
	github.com/gorilla/websocket v1.5.3
	github.com/stretchr/testify v1.12.1
	golang.org/x/crypto v0.59.0
)

require (
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/net v0.62.0 // indirect
	golang.org/x/sync v0.17.0 // indirect
)
