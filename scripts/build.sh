#!/usr/bin/env bash
# Builds the wasm module (adding the Rust target if needed) and prints its size.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

"$(dirname "$0")/ensure-wasm-target.sh"
cd "${REPO_ROOT}"
cargo build --release --target "${WASM_TARGET}"
bytes="$(wc -c <"${WASM_MODULE}" | tr -d ' ')"
printf 'module: %s — %s bytes (%s KiB)\n' "${WASM_MODULE#"${REPO_ROOT}"/}" "${bytes}" "$(( (bytes + 1023) / 1024 ))"
