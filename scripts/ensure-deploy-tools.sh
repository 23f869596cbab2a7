#!/usr/bin/env bash
# Prints the paths of the Debian tools the deployment targets and their tests use, installing
# the packages that are missing when apt-get can run as root (CI, a fresh machine):
#   skopeo           skopeo            (make publish; the image tests push and pull with it)
#   docker-registry  docker-registry   (distribution 2.8: the image tests' local registry)
#   prometheus       prometheus        (the dashboard test's Prometheus; also ships promtool)
#   promtool         prometheus
# Usage: scripts/ensure-deploy-tools.sh skopeo docker-registry ...   (default: all of them)
# One apt-get transaction for everything missing. The packages' init scripts are not run as
# services here (no systemd in CI; policy-rc.d keeps them stopped in containers): the tests
# start each binary themselves on 127.0.0.1 with a config of their own.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

package_of() {
  case "$1" in
    skopeo) echo skopeo ;;
    docker-registry) echo docker-registry ;;
    prometheus|promtool) echo prometheus ;;
    *) die "unknown tool '$1' (known: skopeo docker-registry prometheus promtool)" ;;
  esac
}

tools=("$@")
[[ ${#tools[@]} -gt 0 ]] || tools=(skopeo docker-registry prometheus promtool)

missing=()
for tool in "${tools[@]}"; do
  package="$(package_of "${tool}")"
  command -v "${tool}" >/dev/null 2>&1 || missing+=("${package}")
done

if [[ ${#missing[@]} -gt 0 ]]; then
  # Unique package names, in order.
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | awk '!seen[$0]++')
  if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    say "installing ${missing[*]}: apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  else
    die "missing ${missing[*]}: install Debian's ${missing[*]} (apt-get install ${missing[*]}) or put the tools on PATH"
  fi
fi

for tool in "${tools[@]}"; do
  command -v "${tool}" || die "${tool} still not found after installing $(package_of "${tool}")"
done
