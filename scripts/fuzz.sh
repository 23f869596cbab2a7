#!/usr/bin/env bash
# Fuzz the pure core with libFuzzer (cargo-fuzz), one target at a time, at the lowest CPU
# priority, then print executions and exec/s per target from libFuzzer's final stats.
#
#   scripts/fuzz.sh                  every target for FUZZ_SECONDS (default 60) each
#   scripts/fuzz.sh --smoke          replay the committed seeds, then FUZZ_SMOKE_SECONDS
#                                    (default 10) per target, into a scratch corpus
#   scripts/fuzz.sh usage_chunks     only the named targets
#
# FUZZ_LOG_DIR keeps each target's libFuzzer log (coverage, final stats) in that directory.
# Installs cargo-fuzz when it is missing (and needs a C++ compiler for libFuzzer). Without a
# sanitizer (the default, see below) cargo-fuzz passes only flags stable rustc accepts; with
# FUZZ_SANITIZER=address (or another -Zsanitizer) it needs nightly, installed on demand.
# Inputs the fuzzer finds go to fuzz/corpus/<target>/ (git-ignored), crashes to
# fuzz/artifacts/<target>/.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
cd "${REPO_ROOT}"

FUZZ_SANITIZER="${FUZZ_SANITIZER:-none}"
if [[ "${FUZZ_SANITIZER}" == none ]]; then
  FUZZ_TOOLCHAIN="${FUZZ_TOOLCHAIN:-stable}"
else
  FUZZ_TOOLCHAIN="${FUZZ_TOOLCHAIN:-nightly}"
fi
smoke=0
seconds="${FUZZ_SECONDS:-60}"
targets=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) smoke=1; seconds="${FUZZ_SMOKE_SECONDS:-10}" ;;
    --seconds) seconds="$2"; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (see scripts/fuzz.sh --help)" ;;
    *) targets+=("$1") ;;
  esac
  shift
done
[[ "${seconds}" =~ ^[0-9]+$ ]] || die "FUZZ_SECONDS must be a whole number of seconds, got ${seconds}"

command -v rustup >/dev/null 2>&1 || die "rustup is needed (the ${FUZZ_TOOLCHAIN} toolchain)"
if ! rustup run "${FUZZ_TOOLCHAIN}" rustc --version >/dev/null 2>&1; then
  say "installing the ${FUZZ_TOOLCHAIN} toolchain"
  rustup toolchain install "${FUZZ_TOOLCHAIN}" --profile minimal >&2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  say "installing cargo-fuzz"
  cargo install cargo-fuzz --locked >&2
fi

if [[ ${#targets[@]} -eq 0 ]]; then
  mapfile -t targets < <(cargo "+${FUZZ_TOOLCHAIN}" fuzz list --fuzz-dir fuzz)
fi

# No sanitizer by default: the core has no unsafe code (only src/host/ does, and it is built
# for wasm32 only), so the bugs left to find are panics, overflows and broken invariants,
# which debug assertions and the targets' own asserts catch at several times ASan's speed.
build_flags=(--fuzz-dir fuzz --sanitizer "${FUZZ_SANITIZER}" --debug-assertions)
say "building fuzz targets (${FUZZ_TOOLCHAIN})"
nice -n 19 cargo "+${FUZZ_TOOLCHAIN}" fuzz build "${build_flags[@]}" >&2
# Run the binaries just built rather than `cargo fuzz run`, which rebuilds whenever src/
# changed: every target of one run then fuzzes the same code.
host="$(rustup run "${FUZZ_TOOLCHAIN}" rustc -vV | sed -n 's/^host: //p')"
bin_dir="fuzz/target/${host}/release"

scratch="$(mktemp -d)"
trap 'rm -rf "${scratch}"' EXIT
logs="${FUZZ_LOG_DIR:-${scratch}/logs}"
mkdir -p "${logs}"

dict_for() {
  case "$1" in
    config_parse) echo fuzz/dict/config.dict ;;
    *) echo fuzz/dict/http.dict ;;
  esac
}

final_stat() { grep -Eo "^stat::$1: *[0-9]+" "$2" | grep -Eo '[0-9]+$' | tail -n 1 || echo "?"; }

failed=()
summary=()
for t in "${targets[@]}"; do
  seeds="fuzz/seeds/${t}"
  [[ -d "${seeds}" ]] || die "no seeds for target ${t} in ${seeds} (python3 fuzz/seeds.py writes them)"
  if [[ ${smoke} -eq 1 ]]; then
    corpus="${scratch}/corpus/${t}"
  else
    corpus="fuzz/corpus/${t}"
  fi
  mkdir -p "${corpus}" "fuzz/artifacts/${t}"
  log="${logs}/${t}.log"
  say "== fuzz ${t}: ${seconds} s (corpus ${corpus}, seeds ${seeds})"
  start=$(date +%s)
  status=0
  # The first directory receives new inputs; the seeds are only read.
  nice -n 19 "${bin_dir}/${t}" "${corpus}" "${seeds}" -artifact_prefix="fuzz/artifacts/${t}/" \
    -max_total_time="${seconds}" -timeout=10 -dict="$(dict_for "${t}")" -print_final_stats=1 \
    >"${log}" 2>&1 || status=$?
  elapsed=$(( $(date +%s) - start ))
  execs="$(final_stat number_of_executed_units "${log}")"
  rate="$(final_stat average_exec_per_sec "${log}")"
  if [[ ${status} -eq 0 ]]; then
    verdict="ok"
  else
    verdict="FAILED (exit ${status})"
    failed+=("${t}")
    grep -E "panicked at|Assertion|==ERROR|SUMMARY|Test unit written to|Base64" "${log}" >&2 || tail -n 40 "${log}" >&2
    artifact="$(grep -Eo 'Test unit written to [^ ]+' "${log}" | awk '{print $5}' | tail -n 1)"
    [[ -n "${artifact}" ]] && say "reproduce: ${bin_dir}/${t} ${artifact}  (or: cargo +${FUZZ_TOOLCHAIN} fuzz run ${build_flags[*]} ${t} ${artifact})"
  fi
  summary+=("$(printf '%-16s %6s s %12s execs %8s exec/s  %s' "${t}" "${elapsed}" "${execs}" "${rate}" "${verdict}")")
done

printf '\n== fuzz summary (%s s per target%s) ==\n' "${seconds}" "$([[ ${smoke} -eq 1 ]] && echo ', smoke')"
printf '%s\n' "${summary[@]}"
[[ ${#failed[@]} -eq 0 ]] || die "fuzz targets failed: ${failed[*]}"
