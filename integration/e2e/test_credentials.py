"""End-to-end: raw credentials never leave the request (README: "raw credentials are never
stored, logged or exported"), and what the shipped access log records about each answer
(docs/observability.md#access-logs).

One run of the shipped envoy/envoy.yaml, with the module's log at debug level, sends every kind
of answer the governor gives (upstream rewrites of 429/503, local cooldown and quota answers, a held
request, a pass-through success) with distinctive credentials in each account header and in a
Gemini `?key=` query. Then every output of the run is searched for them: Envoy's log, the
access log, /stats, /stats/prometheus, the admin config dump, and what clients were sent back.
For the native module the same file runs with its wasm filter swapped for the dynamic-module
filter carrying the same configuration JSON.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import requests
import yaml

from conftest import _register, _release
from harness import NATIVE, REPO_ROOT, WASM_MODULE, Envoy, native_filter

SHIPPED_CONFIG = REPO_ROOT / "envoy" / "envoy.yaml"


def shipped_config_text(sim_port: int, access_log: Path) -> str:
    """envoy/envoy.yaml on free ports, in front of the test simulator, logging to a file."""
    text = SHIPPED_CONFIG.read_text()
    for old, new in [
        ("port_value: 9901", "port_value: 0"),
        ("port_value: 10000", "port_value: 0"),
        ("port_value: 8081", f"port_value: {sim_port}"),
        ("filename: target/wasm32-wasip1/release/llm_governor.wasm", f"filename: {WASM_MODULE}"),
        ("path: /dev/stdout", f"path: {access_log}"),
    ]:
        assert text.count(old) == 1, f"envoy/envoy.yaml no longer has exactly one `{old}`"
        text = text.replace(old, new)
    return as_native(text) if NATIVE else text


def as_native(text: str) -> str:
    """The config with its wasm filter replaced by the dynamic-module filter, same JSON."""
    boot = yaml.safe_load(text)
    swapped = 0
    for listener in boot["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                filters = f.get("typed_config", {}).get("http_filters", [])
                for i, hf in enumerate(filters):
                    if hf["name"] == "envoy.filters.http.wasm":
                        filters[i] = native_filter(hf["typed_config"]["config"]["configuration"]["value"])
                        swapped += 1
    assert swapped == 1, f"envoy/envoy.yaml has {swapped} wasm filters, not one"
    return yaml.safe_dump(boot)


def secret(name: str) -> str:
    # Long and unlike anything Envoy prints by itself, so a hit can only be a leak.
    return f"sk-{name}-SECRET{uuid.uuid4().hex}"


def test_credentials_appear_in_no_log_stat_or_answer_and_the_access_log_says_who_answered(sim):
    keys = {name: secret(name) for name in ("openai", "held", "anthropic", "azure", "gemini", "query", "plain")}
    # The secret the ids are keyed with, handed to the VM through the shipped config's
    # host_env_keys: it must never show either.
    keys["hash key"] = secret("hash-key")
    # Not via envoy_factory: the YAML must name the access-log file in this Envoy's workdir.
    envoy = Envoy({}, upstream_port=sim.port, concurrency=2, bootstrap="",
                  extra_args=["--component-log-level", "dynamic_modules:debug" if NATIVE else "wasm:debug"],
                  env={"LLM_GOVERNOR_HASH_KEY": keys["hash key"]})
    envoy.bootstrap = shipped_config_text(sim.port, envoy.access_log_path)
    _register(envoy)
    answers = []
    try:
        with envoy:
            def post(path, headers, body, note):
                r = requests.post(envoy.url + path, headers={**headers, "x-obs-note": note}, json=body, timeout=15)
                answers.append((note, r))
                return r

            chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
            openai = {"authorization": f"Bearer {keys['openai']}"}
            sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 30,
                          "count": 1, "keys": [keys["openai"]]})
            assert post("/v1/chat/completions", openai, chat, "upstream-429").status_code == 429
            # 30 s is past hold.max_ms: answered locally at once.
            local = post("/v1/chat/completions", openai, chat, "cooldown")
            assert local.headers.get("x-llm-governor-source") == "cooldown", dict(local.headers)

            held = {"authorization": f"Bearer {keys['held']}"}
            sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 1,
                          "count": 1, "keys": [keys["held"]]})
            assert post("/v1/chat/completions", held, chat, "held-429").status_code == 429
            r = post("/v1/chat/completions", held, chat, "held")
            assert r.status_code == 200 and "x-llm-governor-held-ms" in r.headers, dict(r.headers)

            anthropic = {"x-api-key": keys["anthropic"], "anthropic-version": "2023-06-01"}
            msg = {"model": "claude-sonnet-4-6", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            sim.scenario({"mode": "quota", "count": 1, "keys": [keys["anthropic"]]})
            assert post("/v1/messages", anthropic, msg, "quota").status_code == 429
            assert post("/v1/messages", anthropic, msg, "quota-local").headers.get("x-llm-governor-source") == "cooldown"

            sim.scenario({"mode": "unavailable", "count": 1, "keys": [keys["azure"]]})
            azure_path = "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"
            assert post(azure_path, {"api-key": keys["azure"]}, chat, "azure-503").status_code == 503

            gemini = {"contents": [{"parts": [{"text": "hi"}]}]}
            sim.scenario({"mode": "gemini_minute", "count": 1, "keys": [keys["gemini"]]})
            gemini_path = "/v1beta/models/gemini-2.0-flash:generateContent"
            assert post(gemini_path, {"x-goog-api-key": keys["gemini"]}, gemini, "gemini-429").status_code == 429
            sim.scenario({"mode": "rate_limited", "count": 1, "keys": [keys["query"]]})
            r = post(f"{gemini_path}?key={keys['query']}&alt=json", {}, gemini, "query-key")
            assert r.status_code == 429, r.text

            sim.scenario({"mode": "ok"})
            assert post("/v1/chat/completions", {"authorization": f"Bearer {keys['plain']}"}, chat, "plain").status_code == 200

            # Histograms and the access log reach their outputs after a flush.
            time.sleep(1.0)
            lines = wait_for_access_log(envoy, len(answers))
            outputs = {
                "envoy log": envoy.log(),
                "access log": "\n".join(lines),
                "/stats": requests.get(envoy.admin_url + "/stats", timeout=5).text,
                "/stats?format=json": requests.get(envoy.admin_url + "/stats?format=json", timeout=5).text,
                "/stats/prometheus": envoy.prometheus(),
                "/config_dump": requests.get(envoy.admin_url + "/config_dump", timeout=5).text,
            }
            for note, r in answers:
                outputs[f"answer {note}"] = "\n".join(f"{k}: {v}" for k, v in r.headers.items()) + "\n" + r.text
    finally:
        _release(envoy)

    assert "starting main dispatch loop" in outputs["envoy log"], "no Envoy log to search"
    assert "ids are keyed with LLM_GOVERNOR_HASH_KEY" in outputs["envoy log"], "the VM did not see the secret"
    for where, text in outputs.items():
        for name, key in keys.items():
            # The secret part alone: a leak of a prefix-stripped or re-encoded value shows too.
            assert key.split("-SECRET", 1)[1] not in text, f"the {name} credential appears in the {where}"

    entries = {}
    for line in lines:
        entry = json.loads(line)
        entries.setdefault(entry["path"], []).append(entry)
    # The path is logged without its query string: the Gemini ?key= stays out of the log.
    assert gemini_path in entries and len(entries[gemini_path]) == 2, sorted(entries)
    assert azure_path.split("?")[0] in entries, sorted(entries)
    assert not [p for p in entries if "?" in p], sorted(entries)
    # `details` tells the provider's answers from the governor's own.
    by_source = {}
    for entry in (e for es in entries.values() for e in es):
        by_source.setdefault((entry["status"], entry["llm_governor_source"]), set()).add(entry["details"])
    assert by_source[(429, "upstream")] == {"via_upstream"}, by_source
    assert by_source[(503, "upstream")] == {"via_upstream"}, by_source
    # ... and the cause of a local answer: a cooling account, or its quota exhausted.
    assert by_source[(429, "cooldown")] == {"llm_governor_cooldown", "llm_governor_quota"}, by_source
    assert by_source[(200, None)] == {"via_upstream"}, by_source


def wait_for_access_log(envoy: Envoy, n: int, timeout_s: float = 10) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in envoy.access_log_lines() if line.startswith("{")]
        if len(lines) >= n or time.monotonic() >= deadline:
            assert len(lines) == n, f"{len(lines)} access-log lines for {n} requests"
            return lines
