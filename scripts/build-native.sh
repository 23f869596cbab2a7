#!/usr/bin/env bash
# Builds the Envoy dynamic module (the same crate for the host's target, profile `native`: as
# release, but a panic unwinds into the hooks' catch_unwind) and installs it as
# target/release/libllm_governor.so, printing its size. The install is a copy then a rename, so
# an Envoy that has the old file loaded keeps its image (never overwrite a loaded .so in place).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "${REPO_ROOT}"

cargo build --profile native --lib -p llm-governor
mkdir -p "$(dirname "${NATIVE_MODULE}")"
cp target/native/libllm_governor.so "${NATIVE_MODULE}.tmp"
mv -f "${NATIVE_MODULE}.tmp" "${NATIVE_MODULE}"
bytes="$(wc -c <"${NATIVE_MODULE}" | tr -d ' ')"
printf 'module: %s — %s bytes (%s KiB)\n' "${NATIVE_MODULE#"${REPO_ROOT}"/}" "${bytes}" "$(( (bytes + 1023) / 1024 ))"
