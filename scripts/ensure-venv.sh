#!/usr/bin/env bash
# Creates .venv and installs the pinned test dependencies (integration/requirements.txt).
# Re-installs only when the requirements file changed; silent when up to date.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

requirements="${REPO_ROOT}/integration/requirements.txt"
stamp="${VENV_DIR}/.requirements.stamp"

if [[ ! -x "${VENV_DIR}/bin/python" ]]; then
  command -v python3 >/dev/null 2>&1 || die "python3 not found: install Python 3.9 or newer"
  say "creating Python virtualenv in .venv"
  python3 -m venv "${VENV_DIR}" >&2 || die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi

if [[ ! -f "${stamp}" ]] || ! cmp -s "${requirements}" "${stamp}"; then
  say "installing test dependencies from integration/requirements.txt"
  "${VENV_DIR}/bin/python" -m pip install --quiet --disable-pip-version-check -r "${requirements}" >&2
  cp "${requirements}" "${stamp}"
fi
