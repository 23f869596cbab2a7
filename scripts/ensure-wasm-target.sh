#!/usr/bin/env bash
# Adds the wasm32-wasip1 Rust target when it is missing; silent when it is there.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

command -v rustup >/dev/null 2>&1 || {
  # Without rustup we cannot add targets; a toolchain that already has it still works.
  rustc --print target-list >/dev/null 2>&1 || die "rustc not found: install Rust with rustup (https://rustup.rs)"
  exit 0
}
if ! rustup target list --installed 2>/dev/null | grep -qx "${WASM_TARGET}"; then
  say "adding Rust target ${WASM_TARGET}"
  rustup target add "${WASM_TARGET}" >&2
fi
