"""The Prometheus alert rules are valid and do what they say: `promtool check rules` on
envoy/prometheus/alerts.yaml and `promtool test rules` on its unit tests (alerts_test.yaml).

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

from harness import REPO_ROOT

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
