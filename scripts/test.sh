#!/usr/bin/env bash
# Every test: native (cargo test --workspace), end-to-end (pytest against a real Envoy and
# the simulator) once per artifact (the wasm module, then the native dynamic module:
# LLM_GOVERNOR_ARTIFACT; E2E_ARTIFACTS="native" runs one), then a short fuzz smoke run. Runs
# all of them even if one fails, then prints one summary.
# Extra arguments go to pytest (e.g. scripts/test.sh -k quota).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
cd "${REPO_ROOT}"

logs="$(mktemp -d)"
trap 'rm -rf "${logs}"' EXIT

export ENVOY_BIN="${ENVOY_BIN:-$(scripts/ensure-envoy.sh)}"
# promtool checks the shipped alert rules; installed from Debian when missing and root.
scripts/ensure-promtool.sh >/dev/null || true

printf '\n== native tests: cargo test --workspace ==\n'
cargo test --workspace 2>&1 | tee "${logs}/unit.log"
unit_status=${PIPESTATUS[0]}

e2e_status=0
for artifact in ${E2E_ARTIFACTS:-wasm native}; do
  printf '\n== end-to-end tests, %s module: pytest integration/e2e (Envoy: %s) ==\n' "${artifact}" "${ENVOY_BIN}"
  started=${SECONDS}
  LLM_GOVERNOR_ARTIFACT="${artifact}" "${VENV_DIR}/bin/python" -m pytest integration/e2e -p no:cacheprovider -rfE "$@" 2>&1 |
    tee "${logs}/e2e-${artifact}.log"
  status=${PIPESTATUS[0]}
  [[ ${status} -eq 0 ]] || e2e_status=${status}
  printf '(%s module: %s s)\n' "${artifact}" "$(( SECONDS - started ))" | tee -a "${logs}/e2e-times.log"
done

printf '\n== fuzz smoke: every fuzz target over its seeds, then %s s each (scripts/fuzz.sh --smoke) ==\n' "${FUZZ_SMOKE_SECONDS:-5}"
FUZZ_SMOKE_SECONDS="${FUZZ_SMOKE_SECONDS:-5}" scripts/fuzz.sh --smoke 2>&1 | tee "${logs}/fuzz.log"
fuzz_status=${PIPESTATUS[0]}

# cargo prints one "test result: ok. N passed; M failed; ..." line per test binary.
sum_cargo() {
  grep -Eo "test result: [A-Za-z]+\. [0-9]+ passed; [0-9]+ failed" "${logs}/unit.log" |
    awk -v want="$1" '{ n = (want == "passed") ? $4 : $6; s += n } END { print s + 0 }'
}
# pytest's closing line: "== 3 failed, 40 passed, 1 skipped, 2 errors in 12.3s ==", per artifact.
pytest_count() {
  local total=0 log n
  for log in "${logs}"/e2e-*.log; do
    [[ "${log}" == *e2e-times.log ]] && continue
    n="$(tail -n 1 "${log}" | grep -Eo "[0-9]+ $1" | grep -Eo "[0-9]+" || echo 0)"
    total=$(( total + n ))
  done
  echo "${total}"
}

unit_passed="$(sum_cargo passed)"
unit_failed="$(sum_cargo failed)"
e2e_passed="$(pytest_count passed)"
e2e_failed=$(( $(pytest_count failed) + $(pytest_count errors?) ))
e2e_skipped="$(pytest_count skipped)"

verdict() { [[ "$1" -eq 0 ]] && echo ok || echo "FAILED (exit $1)"; }
printf '\n== summary ==\n'
printf 'native (cargo test): %s passed, %s failed — %s\n' "${unit_passed}" "${unit_failed}" "$(verdict "${unit_status}")"
printf 'end-to-end (pytest, %s): %s passed, %s failed, %s skipped — %s\n' "${E2E_ARTIFACTS:-wasm native}" "${e2e_passed}" "${e2e_failed}" "${e2e_skipped}" "$(verdict "${e2e_status}")"
cat "${logs}/e2e-times.log" 2>/dev/null || true
printf 'fuzz smoke: %s\n' "$(verdict "${fuzz_status}")"
printf 'total: %s passed, %s failed\n' "$(( unit_passed + e2e_passed ))" "$(( unit_failed + e2e_failed ))"

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
[[ "${unit_status}" -eq 0 && "${e2e_status}" -eq 0 && "${fuzz_status}" -eq 0 ]]
