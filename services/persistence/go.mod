module github.com/keelmq/keel/services/persistence

go 1.26.0
