#!/usr/bin/env bash
# Every test: native (cargo test --workspace), end-to-end (pytest against a real Envoy and
# the simulator), then a short fuzz smoke run. Runs all three even if one fails, then prints one summary.
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

printf '\n== end-to-end tests: pytest integration/e2e (Envoy: %s) ==\n' "${ENVOY_BIN}"
"${VENV_DIR}/bin/python" -m pytest integration/e2e -p no:cacheprovider -rfE "$@" 2>&1 | tee "${logs}/e2e.log"
e2e_status=${PIPESTATUS[0]}

printf '\n== fuzz smoke: every fuzz target over its seeds, then %s s each (scripts/fuzz.sh --smoke) ==\n' "${FUZZ_SMOKE_SECONDS:-5}"
FUZZ_SMOKE_SECONDS="${FUZZ_SMOKE_SECONDS:-5}" scripts/fuzz.sh --smoke 2>&1 | tee "${logs}/fuzz.log"
fuzz_status=${PIPESTATUS[0]}

# cargo prints one "test result: ok. N passed; M failed; ..." line per test binary.
sum_cargo() {
  grep -Eo "test result: [A-Za-z]+\. [0-9]+ passed; [0-9]+ failed" "${logs}/unit.log" |
    awk -v want="$1" '{ n = (want == "passed") ? $4 : $6; s += n } END { print s + 0 }'
}
# pytest's closing line: "== 3 failed, 40 passed, 1 skipped, 2 errors in 12.3s ==".
pytest_count() {
  tail -n 1 "${logs}/e2e.log" | grep -Eo "[0-9]+ $1" | grep -Eo "[0-9]+" || echo 0
}

unit_passed="$(sum_cargo passed)"
unit_failed="$(sum_cargo failed)"
e2e_passed="$(pytest_count passed)"
e2e_failed=$(( $(pytest_count failed) + $(pytest_count errors?) ))
e2e_skipped="$(pytest_count skipped)"

verdict() { [[ "$1" -eq 0 ]] && echo ok || echo "FAILED (exit $1)"; }
printf '\n== summary ==\n'
printf 'native (cargo test): %s passed, %s failed — %s\n' "${unit_passed}" "${unit_failed}" "$(verdict "${unit_status}")"
printf 'end-to-end (pytest): %s passed, %s failed, %s skipped — %s\n' "${e2e_passed}" "${e2e_failed}" "${e2e_skipped}" "$(verdict "${e2e_status}")"
printf 'fuzz smoke: %s\n' "$(verdict "${fuzz_status}")"
printf 'total: %s passed, %s failed\n' "$(( unit_passed + e2e_passed ))" "$(( unit_failed + e2e_failed ))"

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
[[ "${unit_status}" -eq 0 && "${e2e_status}" -eq 0 && "${fuzz_status}" -eq 0 ]]
