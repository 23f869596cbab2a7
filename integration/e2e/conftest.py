"""pytest fixtures for the end-to-end tests.

- `simulator`: one provider simulator for the session; `sim` is the same one, reset per test;
  `simulator_fixtures` builds such a pair for another (a second provider).
- `envoy_factory`: starts Envoys for one test, always stops them, fails the test if one logged a
  `[critical]` wasm line, and attaches their logs to the report when the test fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Envoy, HarnessError, Simulator  # noqa: E402

# Envoys alive for the test that is running (function- and module-scoped), for the failure dump.
_live_envoys: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _live_envoys:
        for envoy in list(_live_envoys):
            report.sections.append(
                (f"Envoy log ({envoy.workdir}/envoy.log, last 80 lines)", envoy.log_tail(80))
            )


def _register(envoy: Envoy) -> Envoy:
    _live_envoys.append(envoy)
    return envoy


def _release(envoy: Envoy) -> None:
    if envoy in _live_envoys:
        _live_envoys.remove(envoy)


def simulator_fixtures(name: str, scope: str, reset_name: str):
    """Two fixtures: `name`, one simulator for `scope`, stopped and removed when the scope ends;
    and `reset_name`, the same simulator with no scenario and no recorded requests, per test."""

    def started():
        with Simulator() as simulator:
            yield simulator

    def reset(request):
        simulator = request.getfixturevalue(name)
        simulator.reset()
        yield simulator

    return pytest.fixture(scope=scope, name=name)(started), pytest.fixture(name=reset_name)(reset)


# The session's provider, and the same one reset for each test.
simulator, sim = simulator_fixtures("simulator", "session", reset_name="sim")


@pytest.fixture
def envoy_factory(simulator):
    """envoy_factory(plugin_config, **kwargs) -> a started Envoy in front of the simulator.

    plugin_config=None starts Envoy without the wasm filter (the "no governor" baseline).
    """
    started: list = []

    def start(plugin_config, **kwargs):
        kwargs.setdefault("upstream_port", simulator.port)
        envoy = _register(Envoy(plugin_config, **kwargs))
        started.append(envoy)
        return envoy.start()

    yield start

    problems = []
    for envoy in started:
        try:
            envoy.stop(check=True)
        except HarnessError as err:
            problems.append(str(err))
        finally:
            _release(envoy)
            envoy.cleanup()
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def module_envoy(plugin_config, **kwargs):
    """Builds a module-scoped fixture body: one Envoy shared by a test module (faster)."""

    def fixture(simulator):
        envoy = _register(Envoy(plugin_config, upstream_port=simulator.port, **kwargs))
        try:
            envoy.start()
            yield envoy
        finally:
            _release(envoy)
            envoy.stop(check=False)
            critical = envoy.critical_wasm_lines()
            envoy.cleanup()
            if critical:
                pytest.fail("Envoy logged critical wasm lines:\n" + "\n".join(critical), pytrace=False)

    return fixture
