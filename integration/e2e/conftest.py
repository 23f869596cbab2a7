"""pytest fixtures for the end-to-end tests.

- `simulator`: one provider simulator for the session; `sim` is the same one, reset per test.
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


@pytest.fixture(scope="session")
def simulator():
    sim = Simulator().start()
    yield sim
    sim.stop()


@pytest.fixture
def sim(simulator):
    """The session's simulator, with no scenario and no recorded requests."""
    simulator.reset()
    yield simulator


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
