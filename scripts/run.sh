#!/usr/bin/env bash
# `make run`: the provider simulator on 127.0.0.1:8081 and Envoy with envoy/envoy.yaml on
# 127.0.0.1:10000 (admin 127.0.0.1:9901). Ctrl-C stops both; if either dies, so does the other.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "${REPO_ROOT}"  # envoy/envoy.yaml names the module relative to the repository root

SIM_ADDR="127.0.0.1:8081"
LISTEN_URL="http://127.0.0.1:10000"
ADMIN_URL="http://127.0.0.1:9901"
RUN_DIR="${REPO_ROOT}/.run"
mkdir -p "${RUN_DIR}"

envoy_bin="${ENVOY_BIN:-$(scripts/ensure-envoy.sh)}"
[[ -f "${WASM_MODULE}" ]] || die "${WASM_MODULE} missing: run make build"
[[ -x "${SIM_BIN}" ]] || die "${SIM_BIN} missing: run make sim"

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for port in 8081 10000 9901; do
  port_busy "${port}" && die "127.0.0.1:${port} is already in use (another make run?); stop that first"
done

sim_pid=""
envoy_pid=""
cleanup() {
  trap - INT TERM EXIT
  for pid in "${envoy_pid}" "${sim_pid}"; do
    [[ -n "${pid}" ]] && kill "${pid}" 2>/dev/null || true
  done
  for pid in "${envoy_pid}" "${sim_pid}"; do
    [[ -n "${pid}" ]] && wait "${pid}" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'echo; echo "stopping"; exit 0' INT TERM

"${SIM_BIN}" --listen "${SIM_ADDR}" >"${RUN_DIR}/llm-sim.log" 2>&1 </dev/null &
sim_pid=$!

# --disable-hot-restart: no shared-memory region, so this never clashes with test Envoys.
"${envoy_bin}" --config-path envoy/envoy.yaml --concurrency 2 --disable-hot-restart \
  --log-level warn --component-log-level wasm:info \
  --log-path "${RUN_DIR}/envoy.log" --file-flush-interval-msec 500 </dev/null &
envoy_pid=$!

wait_ok() {  # url pid name log
  for _ in $(seq 1 200); do
    kill -0 "$2" 2>/dev/null || { say "$3 exited during start-up; log ($4):"; tail -n 30 "$4" >&2; exit 1; }
    if (exec 3<>"/dev/tcp/127.0.0.1/${1}") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  say "$3 did not start within 20 s; log ($4):"; tail -n 30 "$4" >&2; exit 1
}
http_ready() {  # port path: true when GET answers 200
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' "$2" >&3
  local status
  read -r _ status _ <&3 || true
  exec 3<&-
  [[ "${status}" == "200" ]]
}

wait_ok 8081 "${sim_pid}" llm-sim "${RUN_DIR}/llm-sim.log"
for _ in $(seq 1 200); do
  kill -0 "${envoy_pid}" 2>/dev/null || { say "Envoy exited during start-up; log (.run/envoy.log):"; tail -n 30 "${RUN_DIR}/envoy.log" >&2; exit 1; }
  http_ready 9901 /ready 2>/dev/null && break
  sleep 0.1
done
http_ready 9901 /ready 2>/dev/null || { say "Envoy not ready within 20 s; log (.run/envoy.log):"; tail -n 30 "${RUN_DIR}/envoy.log" >&2; exit 1; }

cat <<INFO

llm-governor is running: Envoy ${LISTEN_URL} -> provider simulator http://${SIM_ADDR}

  OpenAI dialect:
    curl -s ${LISTEN_URL}/v1/chat/completions -H 'authorization: Bearer sk-demo' \\
      -H 'content-type: application/json' \\
      -d '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}'

  Anthropic dialect:
    curl -s ${LISTEN_URL}/v1/messages -H 'x-api-key: sk-ant-demo' -H 'anthropic-version: 2023-06-01' \\
      -H 'content-type: application/json' \\
      -d '{"model":"claude-sonnet-4-6","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}'

  Make the provider rate-limit the next 3 requests, then watch the rewritten headers (curl -i):
    curl -s http://${SIM_ADDR}/_sim/scenario -d '{"mode":"rate_limited","retry_after":"seconds","retry_after_s":2,"count":3}'

  Stats:  ${ADMIN_URL}/stats?filter=llm_governor
          ${ADMIN_URL}/stats/prometheus
  Logs:   .run/envoy.log  .run/llm-sim.log

Access log lines (one JSON line per request) follow below. Ctrl-C stops everything.
INFO

# Returns when either process exits (or on Ctrl-C via the trap).
set +e
wait -n "${sim_pid}" "${envoy_pid}"
status=$?
set -e
if [[ "${status}" -eq 0 ]]; then
  # A clean exit: Envoy or llm-sim was asked to stop (e.g. Ctrl-C reached it directly).
  say "stopped"
  exit 0
fi
say "a process exited with status ${status}; stopping. See .run/envoy.log and .run/llm-sim.log"
exit 1
