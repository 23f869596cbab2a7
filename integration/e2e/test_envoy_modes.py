"""End-to-end: the ways Envoy runs the filter.

- HTTP/2 clients (h2c, prior knowledge, on the listener's `codec_type: AUTO`): a governed
  upstream 429, a local cooldown answer and a held request over HTTP/2, and clients that reset
  their streams (RST_STREAM) while held, mid-body and while upstream, leaving nothing stuck.
- A live configuration change through a file-based LDS listener: a cooldown survives a jitter
  change, a renamed pool starts without the old pool's cooldowns, an invalid configuration is
  refused while the old listener keeps serving, and a new VM with the same `vm_id` (what
  `FAIL_RELOAD` creates after a crash) still sees the cooldowns and buckets in shared data.
- Envoy's own header limit: 431 above `max_request_headers_kb` (60 KiB by default).

HTTP/2 responses are read with curl (`--http2-prior-knowledge`, built with nghttp2); resets are
sent by a few lines of raw HTTP/2 framing below, so no Python HTTP/2 package is needed. Every
wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import pytest

from harness import (CHAT, CHAT_PATH, NATIVE, Envoy, cool, envoy_bootstrap, native_filter, new_key, post, wait_for,
                     wasm_filter, wasm_only)

POOLS = [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}]


def envoy_stat(envoy, name: str) -> int:
    return int(envoy.stat(name, 0) or 0)


# --------------------------------------------------------------------------------------------
# HTTP/2 clients: curl for whole exchanges, raw frames for resets


def curl_http2() -> Optional[str]:
    curl = shutil.which("curl")
    if not curl:
        return None
    features = subprocess.run([curl, "-V"], capture_output=True, text=True, timeout=10).stdout
    return curl if "HTTP2" in features else None


needs_curl_http2 = pytest.mark.skipif(curl_http2() is None, reason="needs curl built with HTTP/2 (nghttp2)")


class H2Reply:
    def __init__(self, version: str, status: int, headers: dict, body: bytes, seconds: float):
        self.version = version
        self.status = status
        self.headers = headers
        self.body = body
        self.seconds = seconds


def h2_post(envoy, key: str, headers: Optional[dict] = None, timeout_s: float = 30.0) -> H2Reply:
    """One POST over h2c with prior knowledge (no HTTP/1.1 upgrade), read with curl."""
    curl = curl_http2()
    assert curl, "curl with HTTP/2 support is required"
    with tempfile.TemporaryDirectory(prefix="h2-") as tmp:
        head, body = Path(tmp) / "head", Path(tmp) / "body"
        args = [
            curl, "-sS", "--http2-prior-knowledge", "--max-time", str(timeout_s),
            "-X", "POST", envoy.url + CHAT_PATH,
            "-H", "content-type: application/json", "-H", f"authorization: Bearer {key}",
            "--data-binary", json.dumps(CHAT), "-D", str(head), "-o", str(body),
            "-w", "%{http_version} %{http_code}",
        ]
        for name, value in (headers or {}).items():
            args += ["-H", f"{name}: {value}"]
        started = time.monotonic()
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s + 10)
        seconds = time.monotonic() - started
        assert done.returncode == 0, f"curl failed ({done.returncode}): {done.stderr}"
        version, status = done.stdout.split()
        parsed: dict = {}
        for line in head.read_text(errors="replace").splitlines()[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                parsed[name.strip().lower()] = value.strip()
        return H2Reply(version, int(status), parsed, body.read_bytes(), seconds)


# Frame types and flags (RFC 9113).
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out = [limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _hpack(headers: list) -> bytes:
    """Literal header fields without indexing, new names, no Huffman: valid HPACK, no state."""
    out = b""
    for name, value in headers:
        n, v = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v
    return out


class RawH2:
    """One h2c connection that sends frames by hand, so a test can reset a stream when it
    wants to. A reader thread acknowledges SETTINGS and PING and records which frames arrive
    on which stream (it does not decode headers: curl reads whole responses above)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.frames: list = []  # (type, flags, stream id)
        self.lock = threading.Lock()
        self.closed = False
        self._send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        self.frame(SETTINGS, 0, 0, b"")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _send(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        header = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
        self._send(header + payload)

    def _recv_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def _read(self) -> None:
        try:
            while True:
                head = self._recv_exact(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = self._recv_exact(length)
                self.frames.append((kind, flags, stream))
                if kind == SETTINGS and not flags & ACK:
                    self.frame(SETTINGS, ACK, 0, b"")
                elif kind == PING and not flags & ACK:
                    self.frame(PING, ACK, 0, payload)
        except (OSError, ConnectionError):
            self.closed = True

    def request(self, stream: int, key: str, body: bytes, end_stream: bool = True, port: int = 0) -> None:
        headers = [
            (":method", "POST"), (":scheme", "http"), (":path", CHAT_PATH), (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/json"), ("authorization", f"Bearer {key}"),
        ]
        if end_stream:
            headers.append(("content-length", str(len(body))))
        self.frame(HEADERS, END_HEADERS, stream, _hpack(headers))
        self.frame(DATA, END_STREAM if end_stream else 0, stream, body)

    def reset(self, stream: int) -> None:
        self.frame(RST_STREAM, 0, stream, struct.pack(">I", CANCEL))

    def ended(self, stream: int) -> bool:
        """The server finished the stream (END_STREAM) or reset it."""
        return any(
            s == stream and (k == RST_STREAM or (k in (DATA, HEADERS) and f & END_STREAM))
            for k, f, s in list(self.frames)
        )

    def answered(self, stream: int) -> bool:
        return any(s == stream and k == HEADERS for k, _, s in list(self.frames))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


@pytest.fixture
def h2_envoy(envoy_factory):
    """Hold off: every cooled request is answered at once, locally."""
    return envoy_factory({"pools": POOLS, "hold": {"max_ms": 0}})


@needs_curl_http2
def test_http2_client_gets_the_governed_429_and_the_local_cooldown_answer(h2_envoy, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after_s": 20, "count": 1, "keys": [key]})
    first = h2_post(h2_envoy, key)
    assert first.version == "2", "the exchange was not HTTP/2"
    assert first.status == 429
    assert first.headers["x-llm-governor-source"] == "upstream"
    assert first.headers["x-llm-governor-class"] == "rate_limited"
    assert first.headers["x-should-retry"] == "true"
    assert 20_000 <= int(first.headers["retry-after-ms"]) <= 24_000

    second = h2_post(h2_envoy, key)
    assert (second.version, second.status) == ("2", 429)
    assert second.headers["x-llm-governor-source"] == "cooldown"
    assert 0 < int(second.headers["retry-after-ms"]) <= 24_000
    assert json.loads(second.body)["error"]["type"], second.body
    assert [q["status"] for q in sim.requests_for(key)] == [429], "the cooled request reached the provider"
    assert envoy_stat(h2_envoy, "http.llm_gateway.downstream_rq_http2_total") >= 2
    assert h2_envoy.pool_stat("openai", "local_reject_cooldown") == 1


@needs_curl_http2
def test_http2_request_is_held_through_a_cooldown_and_released(envoy_factory, sim):
    envoy = envoy_factory({"pools": POOLS})
    key = new_key()
    cool(sim, envoy, key, 2)
    reply = h2_post(envoy, key)
    assert (reply.version, reply.status) == ("2", 200), reply.body
    held_ms = int(reply.headers["x-llm-governor-held-ms"])
    assert 800 <= held_ms <= 2_600, held_ms
    assert [q["status"] for q in sim.requests_for(key)] == [429, 200]
    assert wait_for(lambda: envoy.pool_stat("openai", "held_requests") == 0)


@needs_curl_http2
def test_http2_streams_reset_while_held_leave_nothing_and_spare_their_neighbour(envoy_factory, sim):
    envoy = envoy_factory({"pools": POOLS})
    key = new_key()
    cool(sim, envoy, key, 3)
    body = json.dumps(CHAT).encode()
    h2 = RawH2(envoy.port)
    try:
        for stream in (1, 3, 5):
            h2.request(stream, key, body, port=envoy.port)
        assert wait_for(lambda: envoy.pool_stat("openai", "held_requests") == 3), (
            "three streams on one connection were not held"
        )
        h2.reset(1)
        h2.reset(3)
        assert wait_for(lambda: envoy.pool_stat("openai", "held_requests") == 1), "a reset stream stayed held"
        # A held stream does not hold up its connection: another account's request goes now.
        h2.request(7, new_key(), body, port=envoy.port)
        assert wait_for(lambda: h2.ended(7), timeout_s=2), f"stream 7 waited behind the held one: {h2.frames}"
        assert not h2.ended(5)
        # Stream 5 of the same connection is still held, then released when the cooldown ends.
        assert wait_for(lambda: h2.ended(5), timeout_s=10), f"stream 5 never finished: {h2.frames}"
        assert h2.answered(5) and not h2.closed
        assert [q["status"] for q in sim.requests_for(key)] == [429, 200], "a reset stream reached the provider"
    finally:
        h2.close()
    assert wait_for(lambda: envoy.pool_stat("openai", "held_requests") == 0)
    assert wait_for(lambda: envoy_stat(envoy, "http.llm_gateway.downstream_rq_active") == 0)
    assert envoy.pool_stat("openai", "hold_released") == 1
    # The account is not stuck: its next request goes at once.
    reply = h2_post(envoy, key)
    assert reply.status == 200 and reply.seconds < 2.0, reply.headers


@needs_curl_http2
def test_http2_stream_reset_mid_body_during_a_cooldown_leaves_nothing(h2_envoy, sim):
    key = new_key()
    cool(sim, h2_envoy, key, 20)
    body = json.dumps(CHAT).encode()
    h2 = RawH2(h2_envoy.port)
    try:
        # Headers and half a body: the local answer waits for the end of the body.
        h2.request(1, key, body[: len(body) // 2], end_stream=False, port=h2_envoy.port)
        assert wait_for(lambda: envoy_stat(h2_envoy, "http.llm_gateway.downstream_rq_active") == 1)
        h2.reset(1)
        assert wait_for(lambda: envoy_stat(h2_envoy, "http.llm_gateway.downstream_rq_active") == 0)
        # The connection lives on: the next stream on it is answered locally, at once.
        h2.request(3, key, body, port=h2_envoy.port)
        assert wait_for(lambda: h2.ended(3)), f"stream 3 never finished: {h2.frames}"
        assert not h2.closed
    finally:
        h2.close()
    assert [q["status"] for q in sim.requests_for(key)] == [429]
    assert h2_envoy.pool_stat("openai", "local_reject_cooldown") >= 1
    assert wait_for(lambda: envoy_stat(h2_envoy, "http.llm_gateway.downstream_rq_active") == 0)


@needs_curl_http2
def test_http2_stream_reset_while_upstream_frees_its_in_flight_slot(envoy_factory, sim):
    config = {
        "pools": POOLS,
        "hold": {"max_ms": 0},
        "limits": [{"name": "cap", "key": "account", "max_in_flight": 1}],
    }
    envoy = envoy_factory(config)
    key = new_key()
    sim.scenario({"mode": "ok", "latency_ms": 3_000, "keys": [key]})
    h2 = RawH2(envoy.port)
    try:
        h2.request(1, key, json.dumps(CHAT).encode(), port=envoy.port)
        assert wait_for(lambda: envoy.pool_stat("openai", "in_flight") == 1), "the request never went upstream"
        h2.reset(1)
        assert wait_for(lambda: envoy.pool_stat("openai", "in_flight") == 0), "the reset stream kept its slot"
        assert wait_for(lambda: envoy_stat(envoy, "http.llm_gateway.downstream_rq_active") == 0)
    finally:
        h2.close()
    sim.scenario({"mode": "ok"})
    reply = h2_post(envoy, key)
    assert reply.status == 200, (reply.status, reply.headers)


# --------------------------------------------------------------------------------------------
# A live configuration change through a file-based LDS listener


class LdsGateway:
    """Envoy whose listener comes from a file (`path_config_source`); `push` writes a new
    version next to it and renames it into place, which is how Envoy wants the file replaced."""

    def __init__(self, simulator, plugin_config, **filter_args):
        self.upstream_port = simulator.port
        # Port 0 in every version: an update of the same listener keeps its bound socket, so
        # the port Envoy picked first stays (and no other process can race for it).
        self.listener_port = 0
        self.version = 0
        static = envoy_bootstrap(simulator.port, [], listener_port=self.listener_port)
        self.envoy = Envoy(None, upstream_port=simulator.port, bootstrap={})
        self.lds_path = self.envoy.workdir / "lds.json"
        self.envoy.bootstrap = {
            "node": {"id": "llm-governor-e2e", "cluster": "llm-governor-e2e"},
            "admin": static["admin"],
            "stats_config": static["stats_config"],
            "dynamic_resources": {"lds_config": {"resource_api_version": "V3", "path_config_source": {"path": str(self.lds_path)}}},
            "static_resources": {"clusters": static["static_resources"]["clusters"]},
        }
        self.envoy.plugin_config = plugin_config  # so the harness checks the module exists
        # `[critical]` wasm lines a test expects (a refused configuration logs some).
        self.expected_critical: tuple = ()
        self._write(self._listener(plugin_config, **filter_args))

    def _listener(self, plugin_config, vm_configuration: Optional[str] = None, **filter_args) -> dict:
        if NATIVE:
            # A dynamic module has no VM (and no failure policy): the filter, as configured.
            bootstrap = envoy_bootstrap(self.upstream_port, [native_filter(plugin_config)], listener_port=self.listener_port)
            return bootstrap["static_resources"]["listeners"][0]
        wasm = wasm_filter(plugin_config, **filter_args)
        if vm_configuration is not None:
            wasm["typed_config"]["config"]["vm_config"]["configuration"] = {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": vm_configuration,
            }
        bootstrap = envoy_bootstrap(self.upstream_port, [wasm], listener_port=self.listener_port)
        return bootstrap["static_resources"]["listeners"][0]

    def _write(self, listener: dict) -> None:
        self.version += 1
        document = {
            "version_info": str(self.version),
            "resources": [{"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **listener}],
        }
        staging = self.lds_path.with_name("lds.json.next")
        staging.write_text(json.dumps(document))
        os.rename(staging, self.lds_path)

    def active_version(self) -> Optional[str]:
        """The version Envoy last accepted, once no listener or filter chain is warming or
        draining (a change of the HTTP filters is an in-place filter-chain update)."""
        stats = self.envoy.stats("^listener_manager\\.")
        settled = all(
            int(stats.get(f"listener_manager.{name}") or 0) == 0
            for name in ("total_listeners_warming", "total_listeners_draining", "total_filter_chains_draining")
        )
        version = stats.get("listener_manager.lds.version_text")
        return str(version) if settled and version is not None else None

    def push(self, plugin_config, expect: str = "accepted", **filter_args) -> None:
        """Writes the next version; waits until it serves, or until Envoy says it refused it."""
        accepted = envoy_stat(self.envoy, "listener_manager.lds.update_success")
        rejected = envoy_stat(self.envoy, "listener_manager.lds.update_rejected")
        self._write(self._listener(plugin_config, **filter_args))
        if expect == "accepted":
            assert wait_for(lambda: envoy_stat(self.envoy, "listener_manager.lds.update_success") > accepted), (
                "Envoy did not take the new listener:\n" + self.envoy.log_tail()
            )
            # The old filter chains drain (--drain-time-s 0): new connections use the new one.
            assert wait_for(lambda: self.active_version() == str(self.version)), self.envoy.log_tail()
            assert self.envoy._listener_port() == self.envoy.port, "the update moved the listener"
        else:
            assert wait_for(lambda: envoy_stat(self.envoy, "listener_manager.lds.update_rejected") > rejected), (
                "Envoy did not refuse the new listener:\n" + self.envoy.log_tail()
            )


@pytest.fixture
def lds(simulator):
    """lds(plugin_config) -> a started LdsGateway, cleaned up like every envoy_factory Envoy."""
    import conftest

    started: list = []

    def start(plugin_config, **filter_args) -> LdsGateway:
        gateway = LdsGateway(simulator, plugin_config, **filter_args)
        conftest._register(gateway.envoy)
        started.append(gateway)
        gateway.envoy.start()
        assert gateway.active_version() == "1"
        return gateway

    yield start
    for gateway in started:
        conftest._release(gateway.envoy)
        gateway.envoy.stop(check=False)
        critical = [
            line
            for line in gateway.envoy.critical_wasm_lines()
            if not any(expected in line for expected in gateway.expected_critical)
        ]
        gateway.envoy.cleanup()
        assert not critical, "Envoy logged critical wasm lines:\n" + "\n".join(critical)


def lds_config(jitter: float = 0.2, pool: str = "openai", **extra) -> dict:
    return {
        "pools": [{**POOLS[0], "name": pool}],
        "retry_after": {"jitter": jitter},
        "hold": {"max_ms": 0},
        **extra,
    }


def test_lds_a_cooldown_survives_a_jitter_change(lds, sim):
    gateway = lds(lds_config(jitter=0.2))
    key = new_key()
    cool(sim, gateway.envoy, key, 30)
    gateway.push(lds_config(jitter=0.05))
    r = post(gateway.envoy, key)
    assert r.status_code == 429 and r.headers["x-llm-governor-source"] == "cooldown", dict(r.headers)
    # Told what is left of the 30 s, plus at most the new 5 % of it.
    assert 25_000 <= int(r.headers["retry-after-ms"]) <= 31_500
    assert [q["status"] for q in sim.requests_for(key)] == [429], "the change let a doomed request through"


def test_lds_a_renamed_pool_starts_without_the_old_cooldowns(lds, sim):
    gateway = lds(lds_config(pool="openai"))
    key = new_key()
    cool(sim, gateway.envoy, key, 30)
    assert post(gateway.envoy, key).headers["x-llm-governor-source"] == "cooldown"
    # Cooldowns are kept per (pool name, account): the same requests under a new name are new.
    gateway.push(lds_config(pool="openai-v2"))
    r = post(gateway.envoy, key)
    assert r.status_code == 200, (r.status_code, dict(r.headers))
    assert [q["status"] for q in sim.requests_for(key)] == [429, 200]
    assert gateway.envoy.pool_stat("openai-v2", "local_reject_cooldown") == 0


def test_lds_an_invalid_configuration_is_refused_and_the_old_one_keeps_serving(lds, sim):
    gateway = lds(lds_config())
    # Envoy says so at critical level: "Plugin llm_governor failed to load", then per worker
    # "Plugin configured to fail closed failed to load" (its wording, whatever the policy).
    gateway.expected_critical = ("failed to load",)
    key = new_key()
    cool(sim, gateway.envoy, key, 30)
    gateway.push({"pools": POOLS, "retry_after": {"jitter": 5}}, expect="refused")
    assert wait_for(
        lambda: "llm_governor: invalid configuration: retry_after.jitter: must be between 0 and 1" in gateway.envoy.log()
    ), gateway.envoy.log_tail()
    assert gateway.active_version() == "1"
    # The old listener and its configuration still serve, cooldown included.
    r = post(gateway.envoy, key)
    assert r.status_code == 429 and r.headers["x-llm-governor-source"] == "cooldown", dict(r.headers)
    # A valid version after the refused one is taken as usual.
    gateway.push(lds_config(jitter=0.1))
    assert post(gateway.envoy, key).headers["x-llm-governor-source"] == "cooldown"
    assert [q["status"] for q in sim.requests_for(key)] == [429]


def vms_created(envoy) -> int:
    return envoy_stat(envoy, "wasm.envoy.wasm.runtime.v8.created")


@wasm_only("a dynamic module has no VM to replace (and no failure_policy); its state is process memory")
def test_a_new_vm_with_the_same_vm_id_keeps_cooldowns_and_buckets(lds, sim):
    """What FAIL_RELOAD does after a crash, forced without one: a changed
    `vm_config.configuration` makes Envoy start new VMs; shared data is keyed by vm_id."""
    config = lds_config(limits=[{"name": "tenant", "key": "header:x-tenant", "requests_per_minute": 1}])
    gateway = lds(config, failure_policy="FAIL_RELOAD")
    key, tenant = new_key(), {"x-tenant": f"t-{uuid.uuid4().hex[:8]}"}
    cool(sim, gateway.envoy, key, 30)
    other = new_key()
    assert post(gateway.envoy, other, headers=tenant).status_code == 200  # the tenant's one request a minute
    second = post(gateway.envoy, other, headers=tenant)
    assert second.status_code == 429 and second.headers["x-llm-governor-source"] == "limit"

    before = vms_created(gateway.envoy)
    gateway.push(config, failure_policy="FAIL_RELOAD", vm_configuration="generation-2")
    assert wait_for(lambda: vms_created(gateway.envoy) > before), "no new VM was started"

    cooled = post(gateway.envoy, key)
    assert cooled.status_code == 429 and cooled.headers["x-llm-governor-source"] == "cooldown", dict(cooled.headers)
    limited = post(gateway.envoy, new_key(), headers=tenant)
    assert limited.status_code == 429 and limited.headers["x-llm-governor-source"] == "limit", dict(limited.headers)
    assert [q["status"] for q in sim.requests_for(key)] == [429]


# --------------------------------------------------------------------------------------------
# Envoy's header limit


def padding(total_kib: float, headers: int) -> dict:
    """Request headers adding up to total_kib (the simulator takes lines up to 16 KiB)."""
    each = int(total_kib * 1024 / headers)
    return {f"x-padding-{i}": "a" * each for i in range(headers)}


def test_request_headers_above_60_kib_get_envoys_431_and_never_reach_the_provider(envoy_factory, sim):
    envoy = envoy_factory({"pools": POOLS})
    small, large = new_key(), new_key()
    # Just under the default max_request_headers_kb (60): passes, governed as usual.
    r = post(envoy, small, headers=padding(58, 4))
    assert r.status_code == 200, r.text
    r = post(envoy, large, headers=padding(61, 5))
    assert r.status_code == 431
    assert sim.requests_for(large) == []
    assert [q["status"] for q in sim.requests_for(small)] == [200]


@needs_curl_http2
def test_http2_request_headers_above_60_kib_get_their_stream_reset(envoy_factory, sim):
    """HTTP/2 has no 431 here: Envoy resets the stream and counts header_list_size_too_large."""
    envoy = envoy_factory({"pools": POOLS})
    key = new_key()
    args = [curl_http2(), "-sS", "--http2-prior-knowledge", "--max-time", "20", "-o", os.devnull, "-w", "%{http_code}",
            "-X", "POST", envoy.url + CHAT_PATH, "-H", f"authorization: Bearer {key}", "--data-binary", json.dumps(CHAT)]
    for name, value in padding(61, 5).items():
        args += ["-H", f"{name}: {value}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and done.stdout == "000", (done.returncode, done.stdout, done.stderr)
    assert "INTERNAL_ERROR" in done.stderr, done.stderr
    assert envoy_stat(envoy, "http2.header_list_size_too_large") == 1
    assert sim.requests_for(key) == []
    # The next request, on a new connection, is served as usual.
    assert h2_post(envoy, key).status == 200
