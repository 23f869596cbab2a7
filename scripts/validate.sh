#!/usr/bin/env bash
# `envoy --mode validate` on every shipped Envoy config in envoy/. Validation really loads the
# module and runs its on_configure, so the embedded plugin configurations are checked too.
# Configs that name the module by another path (e.g. /etc/envoy/ in the Docker image) are
# validated from a copy that points at the freshly built module.
# A config with fleet limits is loaded with `--mode init_only` instead (its ports set to 0):
# the filter refuses an unknown `fleet.cluster` at load by asking Envoy for the cluster, and
# `--mode validate` builds no clusters to ask (every name reads as unknown there).
# The dynamic module's config (envoy/native.yaml) finds target/release/libllm_governor.so by
# ENVOY_DYNAMIC_MODULES_SEARCH_PATH.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

envoy_bin="${ENVOY_BIN:-$("$(dirname "$0")/ensure-envoy.sh")}"
[[ -f "${WASM_MODULE}" ]] || die "${WASM_MODULE} missing: run make build"
[[ -f "${NATIVE_MODULE}" ]] || die "${NATIVE_MODULE} missing: run make build-native"
export ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$(dirname "${NATIVE_MODULE}")"

tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT

status=0
shopt -s nullglob
for config in "${REPO_ROOT}"/envoy/*.yaml "${REPO_ROOT}"/envoy/*.yml "${REPO_ROOT}"/envoy/*.json; do
  name="$(basename "${config}")"
  case "${name}" in
    docker-compose.*|compose.*) continue ;;
  esac
  copy="${tmp}/${name}"
  sed -E "s#(filename:[[:space:]]*\"?)[^\"[:space:]}]*llm_governor\.wasm#\1${WASM_MODULE}#" "${config}" >"${copy}"
  mode=(--mode validate)
  if grep -q '"fleet"' "${copy}"; then
    sed -i -E 's#port_value: [0-9]+\}#port_value: 0}#' "${copy}"

    mode=(--mode init_only --base-id "$(( (RANDOM % 500) + 9000 ))")
  fi
  if out="$(cd "${REPO_ROOT}" && "${envoy_bin}" "${mode[@]}" --config-path "${copy}" --disable-hot-restart 2>&1)"; then
    printf 'ok      envoy/%s\n' "${name}"
  else
    printf 'FAILED  envoy/%s\n' "${name}"
    grep -E '\[(critical|error)\]|llm_governor' <<<"${out}" | tail -20 || true
    status=1
  fi
done
exit "${status}"
