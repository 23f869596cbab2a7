"""The Prometheus alert rules are valid and do what they say: `promtool check rules` on
envoy/prometheus/alerts.yaml and `promtool test rules` on its unit tests (alerts_test.yaml), on
the wasm build's series as written and again with every series renamed to the native build's:
the same alerts fire, with the same labels, whichever build the gateways run. Every selection of
a wasm series in the rules reads `<wasm series> or <native series>` (harness.missing_native_twins).

promtool comes from Debian's `prometheus` package (scripts/ensure-promtool.sh installs it). Where
it is missing these tests skip, except under CI=true, where a missing promtool is a failure:
an unchecked rule file must not pass CI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from harness import REPO_ROOT, WASM_PROMETHEUS_PREFIX, missing_native_twins, native_metric

RULES = REPO_ROOT / "envoy" / "prometheus" / "alerts.yaml"
RULE_TESTS = REPO_ROOT / "envoy" / "prometheus" / "alerts_test.yaml"
INSTALL_HINT = "scripts/ensure-promtool.sh (apt-get install prometheus)"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if path:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(f"promtool is required under CI to check the alert rules: run {INSTALL_HINT}", pytrace=False)
    pytest.skip(f"promtool not installed (run {INSTALL_HINT}); alert rules not checked")


def run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def test_alert_rules_pass_promtool_check(promtool):
    result = run(promtool, "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


def test_alert_rules_fire_on_synthetic_series(promtool):
    result = run(promtool, "test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def alert_names() -> list:
    return [line.split(":", 1)[1].strip() for line in RULES.read_text().splitlines() if line.strip().startswith("- alert:")]


def test_every_alert_has_severity_summary_runbook_and_a_unit_test():
    text = RULES.read_text()
    alerts = alert_names()
    assert len(alerts) == len(set(alerts)), f"duplicate alert names: {alerts}"
    assert len(alerts) >= 11, alerts
    blocks = text.split("- alert:")[1:]
    for name, block in zip(alerts, blocks):
        assert "severity:" in block, f"{name} has no severity label"
        assert "summary:" in block and "description:" in block, f"{name} lacks summary/description"
        assert "runbook_url: \"docs/observability.md#" in block, f"{name} has no runbook anchor"
    # Every alert has a promtool case in which it fires (an expected alert with labels), and
    # the unit tests name no alert that does not exist.
    tested = RULE_TESTS.read_text()
    firing = set()
    for case in tested.split("      - eval_time:")[1:]:
        name = re.search(r"alertname: (\S+)", case)
        if name and "exp_labels:" in case:
            firing.add(name.group(1))
    untested = [name for name in alerts if name not in firing]
    assert not untested, f"alerts with no promtool case that fires them: {untested}"
    unknown = sorted(set(re.findall(r"alertname: (\S+)", tested)) - set(alerts))
    assert not unknown, f"alerts_test.yaml tests alerts alerts.yaml does not define: {unknown}"


# A series of alerts_test.yaml's input: the wasm name and its labels.
WASM_SERIES = re.compile(r"\b(" + WASM_PROMETHEUS_PREFIX + r"[a-z_]+)\{([^}]*)\}")


def as_native(text: str) -> str:
    """alerts_test.yaml with every wasm series renamed to the native build's: the family, its
    second label (class, reason, dimension, outcome) added to the series' own labels."""

    def rename(m: re.Match) -> str:
        name, label = native_metric(m.group(1))
        labels = ",".join(x for x in (m.group(2), label) if x)
        return f"{name}{{{labels}}}"

    return WASM_SERIES.sub(rename, text)


def test_the_native_renaming_covers_every_series():
    # The control for the test below: every input series of alerts_test.yaml is a wasm one it
    # renames (or Envoy's own cluster stats, or already native), and none is left behind.
    native = as_native(RULE_TESTS.read_text())
    series = re.findall(r"series: '([a-z_]+)\{", native)
    assert series, "no input series in alerts_test.yaml"
    assert not [s for s in series if s.startswith(WASM_PROMETHEUS_PREFIX)], series
    assert 'envoy_dynamicmodulescustom_llm_governor_upstream{instance="gw-1",job="envoy",llm_pool="openai",class="rate_limited"}' in native
    assert 'envoy_dynamicmodulescustom_llm_governor_local_reject{instance="gw-1",job="envoy",llm_pool="openai",reason="quota"}' in native


def test_alert_rules_fire_on_the_native_builds_series(promtool, tmp_path):
    # Every case of alerts_test.yaml, on the series a native gateway exports: each alert fires
    # (and stays quiet) exactly as on the wasm series, with the same labels and annotations.
    text = as_native(RULE_TESTS.read_text()).replace("  - alerts.yaml\n", f"  - {RULES}\n", 1)
    assert str(RULES) in text
    native_tests = tmp_path / "alerts_test_native.yaml"
    native_tests.write_text(text)
    result = run(promtool, "test", "rules", str(native_tests))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_reads_both_builds():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert len(rules) == len(alert_names())
    for rule in rules:
        expr = rule["expr"]
        assert WASM_PROMETHEUS_PREFIX in expr, f"{rule['alert']} reads no llm-governor series"
        missing = missing_native_twins(expr)
        assert not missing, f"{rule['alert']}: wasm series without the native one beside it: {missing}"
