module github.com/keelmq/keel/services/output

go 1.26.0
