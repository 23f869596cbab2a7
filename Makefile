# llm-governor: build, run and test. Works on a fresh machine with rustup, Python 3 and make;
# the scripts in scripts/ add the wasm target, the test virtualenv and Envoy on demand.

SHELL := /bin/bash
.DEFAULT_GOAL := help

WASM_MODULE := target/wasm32-wasip1/release/llm_governor.wasm
SIM_BIN     := target/release/llm-sim

.PHONY: help build build-native sim rls envoy venv test run lint validate bench storm soak fuzz image publish

help:
	@echo "make build     build the wasm module ($(WASM_MODULE)) and print its size"
	@echo "make build-native  build the Envoy dynamic module (target/release/libllm_governor.so)"
	@echo "make run       provider simulator + Envoy with the module on http://127.0.0.1:10000"
	@echo "make test      native tests and end-to-end tests against a real Envoy (PYTEST_ARGS=\"-k quota\" to select)"
	@echo "make lint      structure (no import cycle in core/src, files within budget: scripts/check-structure.py --report), rustfmt check, clippy (host and wasm32, -D warnings)"
	@echo "make validate  envoy --mode validate on every config in envoy/"
	@echo "make sim       build the provider simulator ($(SIM_BIN))"
	@echo "make rls       build the Limitador-compatible test fixture (integration/limitador-rls; Debian packages on demand)"
	@echo "make envoy     obtain Envoy if needed and print its path"
	@echo "make fuzz      every fuzz target for FUZZ_SECONDS (default 60) each, one at a time, nice'd (nightly + cargo-fuzz on demand)"
	@echo "make soak      10 minutes of mixed traffic, then nothing stuck, counters add up, memory flat (SOAK_SECONDS=...)"
	@echo "make image     the module as an OCI image layout in target/oci (prints its digest, pins deploy/ to it)"
	@echo "make publish   push target/oci with skopeo: make publish REGISTRY=host/repo (PUBLISH_TLS_VERIFY=false for a local one)"

build:
	@scripts/build.sh

build-native:
	@scripts/build-native.sh

sim:
	@cargo build --release -p llm-sim

rls:
	@scripts/build-rls.sh >/dev/null

envoy:
	@scripts/ensure-envoy.sh

venv:
	@scripts/ensure-venv.sh

test: build build-native sim rls envoy venv
	@scripts/test.sh $(PYTEST_ARGS)

run: build sim envoy
	@scripts/run.sh

# The structure first (standard library only, no tool to install): the checker's own tests,
# then the check itself (no cycle in core/src's use graph, every file within its budget).
lint:
	python3 scripts/check-structure.py --self-test
	python3 scripts/check-structure.py
	@scripts/ensure-rust-tools.sh
	@scripts/ensure-wasm-target.sh
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p llm-governor --target wasm32-wasip1 -- -D warnings
	cargo check --quiet --manifest-path fuzz/Cargo.toml --bins

validate: build build-native envoy
	@scripts/validate.sh

storm:
	@bench/storm/run.sh

bench:
	@bench/run.sh

soak: build sim envoy venv
	@ENVOY_BIN="$$(scripts/ensure-envoy.sh)" .venv/bin/python bench/soak.py

FUZZ_SECONDS ?= 60
fuzz:
	@FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh

# Deployment: the OCI image Istio's WasmPlugin and Envoy Gateway's EnvoyExtensionPolicy pull
# (README, "Deploy"). `image` rewrites the sha256 in deploy/'s manifests to the digest it
# built, so what you publish is what they pin; make test fails while they pin another one.
image: build
	@python3 scripts/oci_image.py build --rewrite-manifests

publish: image
	@scripts/publish.sh "$(REGISTRY)"
