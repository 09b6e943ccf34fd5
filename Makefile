# Keel — top-level build. Fragments for each area live in mk/*.mk.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules --no-print-directory

ROOT    := $(CURDIR)
TMP     := $(ROOT)/.tmp
TMPBIN  := $(TMP)/bin
BIN     := $(ROOT)/bin
GO      ?= go
export PATH := $(TMPBIN):$(PATH)

SERVICES := edge coordinator router persistence output
MODULES  := libs proto $(addprefix services/,$(SERVICES)) test/bench test/conformance test/e2e

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*?## "} /^[a-zA-Z0-9_.-]+:.*?## / {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

include mk/*.mk
