"""envoy/docker-compose.yaml, as far as a machine without a container engine can prove it:

- the file parses and has the shape `docker compose` reads (one service, image, command,
  volumes, ports), with the image the contract names (envoyproxy/envoy:v1.40-latest);
- every host path it mounts exists after `make build`, and the config it mounts loads the
  module from the path the module is mounted at;
- the same command with the same config runs under the wheel's Envoy 1.40: Envoy comes up with
  the module loaded and governs a request. The only edits are what the container would
  otherwise provide: mounted paths become the host paths they mount, addresses that are
  0.0.0.0 inside the container's own network namespace become 127.0.0.1 (nothing here listens
  beyond loopback), fixed ports become free ones, and the upstream api.openai.com:443 (TLS)
  becomes the simulator (this machine has no network).
"""

from __future__ import annotations

import re

import requests
import yaml

from harness import REPO_ROOT, Envoy, wasm_only

COMPOSE = REPO_ROOT / "envoy" / "docker-compose.yaml"


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def service() -> dict:
    services = compose()["services"]
    assert list(services) == ["envoy"], services
    return services["envoy"]


def mounts() -> dict:
    """{container path: host path} of the service's bind mounts (short syntax SRC:DST[:ro])."""
    out = {}
    for volume in service()["volumes"]:
        parts = volume.split(":")
        assert len(parts) in (2, 3) and (len(parts) == 2 or parts[2] in ("ro", "rw")), volume
        out[parts[1]] = (COMPOSE.parent / parts[0]).resolve()
    return out


def test_the_compose_file_has_the_shape_docker_compose_reads():
    svc = service()
    assert svc["image"] == "envoyproxy/envoy:v1.40-latest"
    assert set(svc) <= {"image", "command", "volumes", "ports", "restart", "environment"}, set(svc)
    assert all(isinstance(arg, str) for arg in svc["command"])
    for port in svc["ports"]:
        assert re.fullmatch(r"(127\.0\.0\.1:)?\d+:\d+", port), port
    # Admin is published on the host's loopback only.
    admin = [p for p in svc["ports"] if p.endswith(":9901")]
    assert admin == ["127.0.0.1:9901:9901"], svc["ports"]


def test_every_mount_exists_after_make_build():
    for container_path, host_path in mounts().items():
        assert host_path.exists(), f"{COMPOSE.name} mounts {host_path} at {container_path}, which does not exist (make build?)"
        assert host_path.is_file(), host_path
    config = mounts()["/etc/envoy/envoy.yaml"]
    # The mounted config loads the module from where the module is mounted.
    filenames = re.findall(r"filename:\s*([^\s}]+)", config.read_text())
    assert filenames and all(f in mounts() for f in filenames), (filenames, list(mounts()))
    assert mounts()[filenames[0]] == (REPO_ROOT / "target" / "wasm32-wasip1" / "release" / "llm_governor.wasm")


def as_on_this_machine(text: str, sim_port: int) -> str:
    for container_path, host_path in mounts().items():
        text = text.replace(container_path, str(host_path))
    text = text.replace("0.0.0.0", "127.0.0.1")
    text = re.sub(r"port_value: 10000\b", "port_value: 0", text)
    # The upstream: the simulator on loopback, plain HTTP, instead of api.openai.com over TLS.
    text = text.replace("socket_address: {address: api.openai.com, port_value: 443}",
                        f"socket_address: {{address: 127.0.0.1, port_value: {sim_port}}}")
    text = re.sub(r"\n      transport_socket:\n(?:        .*\n)+", "\n", text)
    assert "api.openai.com, port_value" not in text and "UpstreamTlsContext" not in text, "upstream not redirected"
    return text


@wasm_only("the compose file runs the wasm module")
def test_the_compose_command_and_config_run_under_the_wheels_envoy(sim):
    command = service()["command"]
    assert command[:3] == ["envoy", "--config-path", "/etc/envoy/envoy.yaml"], command
    assert command[3] == "--config-yaml" and len(command) == 5, command
    config = as_on_this_machine(mounts()["/etc/envoy/envoy.yaml"].read_text(), sim.port)
    override = command[4].replace("0.0.0.0", "127.0.0.1").replace("port_value: 9901", "port_value: 0")
    assert override != command[4], "the admin override was not moved to loopback"
    envoy = Envoy(None, upstream_port=sim.port, bootstrap=config, extra_args=["--config-yaml", override])
    # plugin_config=None only tells the harness not to build a bootstrap: the config above
    # carries the wasm filter itself.
    with envoy:
        assert envoy.pool_stat("openai", "upstream_rate_limited") == 0, "module not loaded"
        sim.scenario({"mode": "rate_limited", "retry_after_s": 3, "count": 1})
        r = requests.post(envoy.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-compose"},
                          json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 429, r.text
        assert r.headers["x-llm-governor-class"] == "rate_limited"
        assert r.headers["x-llm-governor-source"] == "upstream"
        assert int(r.headers["retry-after-ms"]) >= 3000
        assert envoy.pool_stat("openai", "upstream_rate_limited") == 1
        # The admin override took effect: admin answers on the port Envoy chose, not 9901.
        assert envoy.admin_port != 9901
