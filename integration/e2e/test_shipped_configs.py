"""Every shipped Envoy config loads in a real Envoy: `envoy --mode validate` on each of
envoy/*.yaml, with the module path pointed at the module under test (as scripts/validate.sh
does), so `make test` covers what `make validate` checks. Validation loads the module and runs
its on_configure, so the plugin configuration embedded in each file is checked too, which a
control case with a broken one proves.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from harness import NATIVE, NATIVE_MODULE, REPO_ROOT, WASM_MODULE, find_envoy

ENVOY_DIR = REPO_ROOT / "envoy"
# Envoy configs: every YAML in envoy/ except the Docker Compose file.
ALL_SHIPPED = sorted(p for p in ENVOY_DIR.glob("*.y*ml") if not p.name.startswith(("docker-compose", "compose")))
MODULE_PATH = re.compile(r'(filename:\s*"?)[^"\s}]*llm_governor\.wasm')
# The configs of the artifact under test: those loading the wasm module, or (native) the
# dynamic module (found by name in $ENVOY_DYNAMIC_MODULES_SEARCH_PATH).
NATIVE_FILTER = "DynamicModuleFilter"
SHIPPED = [p for p in ALL_SHIPPED if (NATIVE_FILTER in p.read_text()) == NATIVE]
CONTROL = ENVOY_DIR / ("native.yaml" if NATIVE else "minimal.yaml")


def pointed_at_module(config: Path, tmp_path: Path, edit=None) -> Path:
    text = config.read_text()
    if NATIVE:
        assert "dynamic_module_config: {name: llm_governor" in text, f"{config.name} does not load llm_governor"
    else:
        assert MODULE_PATH.search(text), f"{config.name} does not load llm_governor.wasm"
        text = MODULE_PATH.sub(lambda m: m.group(1) + str(WASM_MODULE), text)
    if edit:
        text = edit(text)
    copy = tmp_path / config.name
    copy.write_text(text)
    return copy


def validate(config: Path) -> subprocess.CompletedProcess:
    mode = ["--mode", "validate"]
    text = config.read_text()
    if '"fleet"' in text:
        # As scripts/validate.sh does: the filter asks Envoy for fleet.cluster at load, and
        # `--mode validate` builds no clusters, so a fleet config is initialized for real
        # (`init_only`: nothing is served), its ports set to 0.
        config.write_text(re.sub(r"port_value: \d+\}", "port_value: 0}", text))
        mode = ["--mode", "init_only", "--base-id", str(9000 + os.getpid() % 500)]
    return subprocess.run(
        [find_envoy(), *mode, "--config-path", str(config), "--disable-hot-restart",
         "--log-level", "warn"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(NATIVE_MODULE.parent)},
    )


def test_every_shipped_config_is_covered():
    assert {p.name for p in ALL_SHIPPED} >= {"envoy.yaml", "minimal.yaml", "failover.yaml", "native.yaml"}, ALL_SHIPPED
    wasm = [p for p in ALL_SHIPPED if MODULE_PATH.search(p.read_text())]
    native = [p for p in ALL_SHIPPED if NATIVE_FILTER in p.read_text()]
    assert sorted(wasm + native) == ALL_SHIPPED, "a shipped config loads neither module"


@pytest.mark.parametrize("config", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads_in_envoy(config, tmp_path):
    result = validate(pointed_at_module(config, tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"envoy --mode validate refused envoy/{config.name}:\n{output[-3000:]}"
    assert "invalid configuration" not in output, output[-3000:]
    assert not [line for line in output.splitlines() if "[critical]" in line], output[-3000:]


def test_validation_runs_the_plugins_on_configure(tmp_path):
    # The control: minimal.yaml (native.yaml) with an invalid plugin configuration must fail validation,
    # naming the field, or the passes above would prove nothing about the embedded JSON.
    def break_dialect(text: str) -> str:
        assert text.count('"dialect":"openai"') == 1
        return text.replace('"dialect":"openai"', '"dialect":"klingon"')

    result = validate(pointed_at_module(CONTROL, tmp_path, break_dialect))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "llm_governor: invalid configuration: pools[0].dialect:" in output, output[-3000:]
