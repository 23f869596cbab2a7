#!/usr/bin/env bash
# Makes LiteLLM's proxy available in bench/.venv-litellm (its own venv: its dependencies must not
# mix with the test venv). Shared with `make bench`; idempotent: a venv that already runs
# `litellm --version` is left as it is. Prints nothing on success when already installed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${repo}/bench/.venv-litellm"
pin="litellm[proxy]==1.108.7"
# The fleet storm's (x-litellm) proxies share rpm/tpm through Redis: LiteLLM does not install
# the client itself.
redis_pin="redis==8.1.0"

if [[ -x "${venv}/bin/litellm" ]] && "${venv}/bin/python" -c "import litellm.proxy.proxy_server, redis" >/dev/null 2>&1; then
  exit 0
fi
mkdir -p "${repo}/bench"
exec 9>"${TMPDIR:-/tmp}/llm-governor-venv-litellm.lock"
flock 9
if [[ ! -x "${venv}/bin/python" ]]; then
  echo "creating bench/.venv-litellm" >&2
  python3 -m venv "${venv}" >&2
fi
if [[ ! -x "${venv}/bin/litellm" ]] || ! "${venv}/bin/python" -c "import redis" >/dev/null 2>&1; then
  echo "installing ${pin} ${redis_pin} into bench/.venv-litellm (a few minutes)" >&2
  "${venv}/bin/python" -m pip install --quiet --disable-pip-version-check "${pin}" "${redis_pin}" >&2
fi
