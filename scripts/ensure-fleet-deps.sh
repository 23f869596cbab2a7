#!/usr/bin/env bash
# The fleet test rig's Debian packages: redis-server (the fleet's store), and what the
# Limitador-compatible fixture (integration/limitador-rls) builds with: protobuf-compiler (its
# .proto files), librocksdb-dev and libclang-dev (the `limitador` crate's default features link
# RocksDB; see integration/limitador-rls/README.md). Installed with apt-get when missing and
# root (CI); otherwise it says what to install.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
[[ -f /usr/include/rocksdb/c.h ]] || missing+=(librocksdb-dev)
compgen -G '/usr/lib/llvm-*/lib/libclang.so' >/dev/null || compgen -G '/usr/lib/x86_64-linux-gnu/libclang*.so' >/dev/null || missing+=(libclang-dev)
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
  say "installing the fleet rig's packages: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  exit 0
fi
die "the fleet tests need Debian packages: apt-get install ${missing[*]}"
