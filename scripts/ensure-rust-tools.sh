#!/usr/bin/env bash
# Adds rustfmt and clippy when missing (make lint needs both); silent when present.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

command -v rustup >/dev/null 2>&1 || exit 0
installed="$(rustup component list --installed 2>/dev/null || true)"
for component in rustfmt clippy; do
  if ! grep -q "^${component}" <<<"${installed}"; then
    say "adding Rust component ${component}"
    rustup component add "${component}" >&2
  fi
done
