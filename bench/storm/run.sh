#!/usr/bin/env bash
# `make storm`: builds what the storm needs, then runs bench/storm/storm.py (extra args pass on).
# LiteLLM (configuration d) is optional: if it cannot be installed, the run says so and goes on.
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/build.sh
cargo build --release -p llm-sim
# The fleet storm (configurations x-*) needs the Limitador-compatible fixture and redis-server.
scripts/build-rls.sh >/dev/null
export ENVOY_BIN="${ENVOY_BIN:-$(scripts/ensure-envoy.sh)}"
scripts/ensure-venv.sh
req=bench/storm/requirements.txt
stamp=.venv/.storm-requirements.stamp
if [[ ! -f "${stamp}" ]] || ! cmp -s "${req}" "${stamp}"; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r "${req}"
  cp "${req}" "${stamp}"
fi
bench/storm/ensure-litellm.sh || echo "LiteLLM could not be installed: configuration (d) will be reported as not run" >&2
exec .venv/bin/python bench/storm/storm.py "$@"
