module github.com/buraksezer/olric

go 1.13

require (
	github.com/RoaringBitmap/roaring v1.2.1
	github.com/buraksezer/consistent v0.10.0
	github.com/cespare/xxhash/v2 v2.1.2
	github.com/go-redis/redis/v8 v8.11.5
	github.com/hashicorp/go-multierror v1.1.1
	github.com/hashicorp/go-sockaddr v1.0.2
	github.com/hashicorp/logutils v1.0.0
	github.com/hashicorp/memberlist v0.5.0
	github.com/miekg/dns v1.1.45 // indirect
	github.com/pkg/errors v0.9.1
	github.com/sean-/seed v0.0.0-20170313163322-e2103e2c3529
	github.com/stretchr/testify v1.7.0
	github.com/tidwall/btree v1.1.0
	github.com/tidwall/match v1.1.1
	github.com/tidwall/redcon v1.6.2
	github.com/vmihailenco/msgpack/v5 v5.3.5
	golang.org/x/net v0.29.0 // indirect
	golang.org/x/sync v0.8.0
	gopkg.in/yaml.v2 v2.4.0
)
