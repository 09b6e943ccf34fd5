module github.com/keelmq/keel/services/router

go 1.26.0
