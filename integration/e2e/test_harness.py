"""The harness itself, with a bare Envoy (no wasm filter): if these fail, nothing else means much."""

from __future__ import annotations

from harness import Envoy, envoy_bootstrap, new_key, post


def test_bare_envoys_run_side_by_side_and_proxy_to_the_simulator(envoy_factory, sim):
    first = envoy_factory(None)
    second = envoy_factory(None)
    assert first.port != second.port and first.admin_port != second.admin_port

    key = new_key("sk-harness")
    for envoy in (first, second):
        r = post(envoy, key)
        assert r.status_code == 200, r.text
        assert r.headers.get("server") == "envoy"
        assert envoy.stats()["cluster.provider.upstream_rq_200"] == 1
        assert "envoy_cluster_upstream_rq" in envoy.prometheus()

    assert sim.requests()["by_key"][key] == {"200": 2}


def test_an_envoy_that_refuses_its_configuration_is_reported(simulator):
    broken = envoy_bootstrap(simulator.port, [])
    broken["static_resources"]["clusters"][0]["type"] = "NOT_A_TYPE"

    failure = Envoy(None, upstream_port=simulator.port, bootstrap=broken).start_expecting_failure()

    assert not failure.ready
    assert failure.exit_code not in (None, 0)
    assert "NOT_A_TYPE" in failure.log
