module github.com/keelmq/keel/test/e2e

go 1.26.0
