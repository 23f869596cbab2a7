#!/usr/bin/env bash
# Prints the path of promtool (checks and unit-tests envoy/prometheus/alerts.yaml), installing
# Debian's `prometheus` package when promtool is missing and apt-get can run as root (CI).
# The package also ships a Prometheus server unit; in containers policy-rc.d keeps it stopped.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

if command -v promtool >/dev/null 2>&1; then
  command -v promtool
  exit 0
fi
if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
  say "installing promtool: apt-get install prometheus"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends prometheus >&2
  command -v promtool && exit 0
fi
die "promtool not found: install Debian's prometheus package (apt-get install prometheus) or put promtool on PATH"
