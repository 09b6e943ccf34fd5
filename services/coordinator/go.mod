module github.com/keelmq/keel/services/coordinator

go 1.26.0
