#!/usr/bin/env bash
# Builds the Limitador-compatible test fixture (integration/limitador-rls, its own Cargo
# workspace) after installing what it needs; prints the binary's path. Built from its own
# folder so its .cargo/config.toml (Debian's RocksDB) applies.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

"$(dirname "$0")/ensure-fleet-deps.sh"
cd "${REPO_ROOT}/integration/limitador-rls"
cargo build --release --quiet >&2
echo "${REPO_ROOT}/integration/limitador-rls/target/release/limitador-rls"
