#!/usr/bin/env bash
# `make bench`: installs what the benchmark needs (idempotently), builds llm-governor, the empty
# proxy-wasm module and the open-loop load generator, then runs bench/bench.py.
#   BENCH_QUICK=1     short runs (development; numbers are noisier)
#   BENCH_ONLY=estimate,hotpath,body,instructions,overhead,contention,litellm   pick parts (estimate: the
#                     token estimator against tiktoken's o200k_base on bench/estimate/samples*.jsonl;
#                     hotpath: callgrind on the pure core; body: latency of a 100 KiB body under a
#                     reserving token limit; instructions: callgrind on Envoy itself)
#   BENCH_NO_LITELLM=1  skip installing / running LiteLLM
# Results: bench/out/results.md (table) and bench/out/results.json (every run).
set -euo pipefail
BENCH_DIR="$(cd "$(dirname "$0")" && pwd)"
REPO_ROOT="$(cd "${BENCH_DIR}/.." && pwd)"
source "${REPO_ROOT}/scripts/lib.sh"
cd "${REPO_ROOT}"

need_apt=()
command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)
command -v taskset >/dev/null 2>&1 || need_apt+=(util-linux)
command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)
if ((${#need_apt[@]})); then
  command -v apt-get >/dev/null 2>&1 || die "install ${need_apt[*]} (no apt-get here)"
  sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
  say "installing ${need_apt[*]}"
  ${sudo} apt-get update -qq >&2 && ${sudo} apt-get install -y -qq "${need_apt[@]}" >&2
fi

scripts/build.sh >&2
CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-1}" scripts/build-native.sh >&2
ENVOY_BIN="$(scripts/ensure-envoy.sh)"

BENCH_TARGET="${BENCH_DIR}/.target"
(cd "${BENCH_DIR}/empty-filter" && CARGO_TARGET_DIR="${BENCH_TARGET}" cargo build --quiet --release --target "${WASM_TARGET}")
(cd "${BENCH_DIR}/empty-native" && CARGO_TARGET_DIR="${BENCH_TARGET}" cargo build --quiet --release)
(cd "${BENCH_DIR}/loadgen" && CARGO_TARGET_DIR="${BENCH_TARGET}" cargo build --quiet --release)
(cd "${BENCH_DIR}/core-bench" && CARGO_TARGET_DIR="${BENCH_TARGET}" cargo build --quiet --release)
(cd "${BENCH_DIR}/estimate" && CARGO_TARGET_DIR="${BENCH_TARGET}" cargo build --quiet --release)

# LiteLLM in its own virtualenv: its dependency tree must not touch the test venv.
LITELLM=""
if [[ "${BENCH_NO_LITELLM:-}" != 1 ]]; then
  LL_VENV="${BENCH_DIR}/.venv-litellm"
  if [[ ! -x "${LL_VENV}/bin/litellm" ]]; then
    say "installing litellm[proxy] into bench/.venv-litellm (once)"
    { python3 -m venv "${LL_VENV}" && "${LL_VENV}/bin/pip" install --quiet --disable-pip-version-check 'litellm[proxy]'; } >&2 \
      || say "warning: could not install litellm; the LiteLLM row will say so"
  fi
  [[ -x "${LL_VENV}/bin/litellm" ]] && LITELLM="${LL_VENV}/bin/litellm"
fi

export ENVOY_BIN LITELLM
export WASM_MODULE="${WASM_MODULE}"
export EMPTY_MODULE="${BENCH_TARGET}/${WASM_TARGET}/release/empty_filter.wasm"
export NATIVE_MODULE="${NATIVE_MODULE}"
export EMPTY_NATIVE="${BENCH_TARGET}/release/libempty_native.so"
export LOADGEN="${BENCH_TARGET}/release/bench-loadgen"
export CORE_BENCH="${BENCH_TARGET}/release/core-bench"
export ESTIMATE_ACCURACY="${BENCH_TARGET}/release/estimate-accuracy"
export BENCH_OUT="${BENCH_OUT:-${BENCH_DIR}/out}"
scripts/ensure-venv.sh >&2
exec "${REPO_ROOT}/.venv/bin/python" "${BENCH_DIR}/bench.py"
