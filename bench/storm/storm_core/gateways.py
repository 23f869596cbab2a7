"""What stands between the clients and the provider: configurations (a) to (g), and for the
failover storms (issue 9) (e-fo) and (d-fo), which also reach a second provider.

Envoy, its bootstrap and the filter entry are the e2e harness's (integration/e2e/harness.py);
only the route retry policy of (b) and (c) and the fallback cluster and route of (e-fo) are
added here. Every llm-governor configuration (e*, f, g, x-*) runs the artifact it is given,
"wasm" or "native" (issue 23), or the environment's (LLM_GOVERNOR_ARTIFACT); its `artifact`
says which (None for the configurations without llm-governor).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

from harness import (Envoy, HarnessError, Simulator, artifact_of, terminate, wait_http_ok, envoy_bootstrap,
                     failover_bootstrap, free_port)

from . import REPO_ROOT
from .scenarios import MODEL

LITELLM_VENV = REPO_ROOT / "bench" / ".venv-litellm"

POOLS = [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}]
CAP = {"name": "cap", "key": "account", "max_in_flight": 8}
# The TPM storm's local budget: the provider's 20,000 tokens per minute on the same account.
TPM_LIMIT = {"name": "tpm", "key": "account", "tokens_per_minute": 20_000}
GOVERNOR_CONFIGS = {
    "e": {"pools": POOLS},
    # Opt-in: clients are told twice the provider's time per consecutive failed cooldown round.
    "f": {"pools": POOLS, "retry_after": {"escalate": True}},
    # Hold off: the old default, every request that meets a cooldown is answered locally.
    "g": {"pools": POOLS, "hold": {"max_ms": 0}},
    "e-cap": {"pools": POOLS, "limits": [CAP]},
    # Reserves the estimated input + max_tokens before the call, settles with the usage after.
    "e-tpm": {"pools": POOLS, "limits": [dict(TPM_LIMIT, reserve=True, settle="usage")]},
    # The same, the reservation kept as counted (input: the larger of the estimate and bytes / 4),
    # as OpenAI's TPM counts.
    "e-tpm-resv": {"pools": POOLS, "limits": [dict(TPM_LIMIT, reserve=True, settle="reservation")]},
    # Admits while the bucket holds a token, charges the reported usage after the response.
    "e-tpm-after": {"pools": POOLS, "limits": [dict(TPM_LIMIT, reserve=False)]},
    # The limit as a user writes it: reserve and settle left to their defaults (auto).
    "e-tpm-default": {"pools": POOLS, "limits": [TPM_LIMIT]},
    # Issue 33: releases shared by tenant, and tenants in classes of their own (the operator
    # names the chat tenant interactive by its header; everything else is batch).
    "e-fair": {"pools": POOLS, "hold": {"fair_key": "header:x-tenant-id"}},
    "e-classes": {"pools": POOLS, "hold": {"fair_key": "header:x-tenant-id", "classes": [
        {"name": "interactive", "match": {"header": {"name": "x-tenant-id", "value": "chat"}},
         "weight": 4, "max_ms": 10_000},
        {"name": "batch", "weight": 1, "max_ms": 120_000},
    ]}},
}
# The agents storm (issue 32): an Anthropic pool, and the provider's published limits written as
# one `tokens_per_minute` (the input limit, as a new user would) or per dimension.
ANTHROPIC_POOLS = [{"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"}]
GOVERNOR_CONFIGS.update({
    "e-agents-tpm": {"pools": ANTHROPIC_POOLS,
                     "limits": [{"name": "tpm", "key": "account", "tokens_per_minute": 20_000}]},
    "e-agents-dims": {"pools": ANTHROPIC_POOLS, "limits": [
        {"name": "itpm", "key": "account", "input_tokens_per_minute": 20_000},
        {"name": "otpm", "key": "account", "output_tokens_per_minute": 6_000},
    ]},
})
# (e-fo): the same pool with a fallback pool (README "Failover"), reached only by steering; its
# account is the label of the credential Envoy injects on the fallback route.
FAILOVER_POOLS = [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai", "fallback": ["openai-backup"]},
    {"name": "openai-backup", "dialect": "openai", "account": "backup",
     "match": {"header": {"name": "x-llm-governor-pool", "value": "openai-backup"}}},
]
FAILOVER_CONFIGS = {"e-fo": {"pools": FAILOVER_POOLS}}
# The credential Envoy injects on the fallback route: the key the second provider sees.
BACKUP_KEY = "sk-storm-backup-injected"
# The filter's gauges (README "Stats"): not summed over a storm.
GAUGES = ("remaining_", "limit_", "reset_", "held_requests", "in_flight")
LITELLM_MAX_PARALLEL = {"d": None, "d-cap": 8, "d-fo": None, "d-agents": None, "d-prio": None}

CONFIG_NAMES = {
    "a": "no gateway",
    "b": "Envoy retry 429 x3",
    "c": "Envoy rate_limited_retry_back_off",
    "d": "LiteLLM num_retries=3",
    "d-cap": "LiteLLM num_retries=3, max_parallel_requests=8",
    "d-fo": "LiteLLM num_retries=3, two deployments of one model",
    "d-prio": "LiteLLM num_retries=3, priority scheduler (chat 0, batch 1), deployment rpm 300",
    "e": "Envoy + llm-governor (hold on)",
    "e-cap": "Envoy + llm-governor, max_in_flight 8",
    "e-fo": "Envoy + llm-governor, fallback pool",
    "e-fair": "Envoy + llm-governor, hold.fair_key: header:x-tenant-id",
    "e-classes": "Envoy + llm-governor, fair_key and classes (interactive weight 4, batch 1)",
    "e-tpm": "Envoy + llm-governor, tokens_per_minute 20,000, reserve (settle: usage)",
    "e-tpm-resv": "Envoy + llm-governor, tokens_per_minute 20,000, reserve, settle: reservation (what auto, the default, does for OpenAI)",
    "e-tpm-after": "Envoy + llm-governor, tokens_per_minute 20,000, charged after (reserve: false)",
    "e-tpm-default": "Envoy + llm-governor, tokens_per_minute 20,000, the defaults (reserve, settle: auto)",
    "e-agents-tpm": "Envoy + llm-governor, tokens_per_minute 20,000",
    "e-agents-dims": "Envoy + llm-governor, input_tokens_per_minute 20,000 + output_tokens_per_minute 6,000",
    "d-agents": "LiteLLM, the deployment's input/output token limits",
    "f": "Envoy + llm-governor, escalate",
    "g": "Envoy + llm-governor, hold off",
    "x-once": "3 Envoys, LB 60/30/10, local limits written once",
    "x-split": "3 Envoys, LB 60/30/10, local limits split three ways",
    "x-fleet": "3 Envoys, LB 60/30/10, fleet limits (Limitador-compatible service on Redis)",
    "x-fleet-m": "3 Envoys, LB 60/30/10, fleet limits, the limits file's window 1 s longer than the provider's",
    "x-fleet-c": "3 Envoys, LB 60/30/10, fleet limits (the provider's window) and fleet cooldowns",
    "x-fleet-free": "3 Envoys, LB 60/30/10, fleet limits far above the provider's (only cooldowns act)",
    "x-litellm": "3 LiteLLM proxies, LB 60/30/10, the deployment's rpm 90 / tpm 60,000 shared on one Redis",
}

# The outage through replicas (issue 31): N Envoys of 2 workers each, every client pinned to one
# replica (as behind a balancer with sticky connections), evenly or split 60/30/10; with the
# default configuration, or with a `fleet` section on a Limitador-compatible service on Redis
# (cooldowns and the pace after them shared by the fleet). (r3-litellm): three LiteLLM proxies
# on one Redis, pinned the same way.
REPLICA_SPLITS = {"even": None, "skew": (60, 30, 10)}
REPLICA_CONFIGS = {}
for _n in (1, 3, 6):
    for _split in ("even", "skew") if _n == 3 else ("even",):
        for _fleet in (False, True):
            _key = f"r{_n}" + ("-skew" if _split == "skew" else "") + ("-fleet" if _fleet else "")
            REPLICA_CONFIGS[_key] = (_n, _split, _fleet)
            _who = "one Envoy" if _n == 1 else f"{_n} Envoys, clients " + ("60/30/10" if _split == "skew" else "spread evenly")
            CONFIG_NAMES[_key] = f"{_who}, " + ("a fleet section (cooldowns shared)" if _fleet else "defaults")
CONFIG_NAMES["r3-litellm"] = "3 LiteLLM proxies on one Redis, clients spread evenly"


def cap_config(cap: int, scope: str) -> dict:
    """The fleet-cap storm's (issue 31): `max_in_flight` of the key at `cap`, held requests
    waiting for a slot up to 60 s; with `scope: "fleet"` one cap for every Envoy."""
    config = {"pools": POOLS, "hold": {"max_ms": 60_000},
              "limits": [{"name": "key-cap", "key": "account", "max_in_flight": cap, "scope": scope,
                          "slot_lease_ms": 60_000}]}
    if scope == "fleet":
        config["fleet"] = {"cluster": "llm_governor_ratelimit", "timeout_ms": 100}
    return config


# The fleet-cap storm (issue 31): three Envoys, clients pinned 60/30/10, the provider's
# concurrency limit (6) written as each Envoy's cap (18 in all), split three ways, or once for
# the fleet.
REPLICA_CAPS = {"r3-skew-cap-once": cap_config(6, "local"), "r3-skew-cap-split": cap_config(2, "local"),
                "r3-skew-cap-fleet": cap_config(6, "fleet")}
for _key, _what in (("r3-skew-cap-once", "max_in_flight 6 on each (written once)"),
                    ("r3-skew-cap-split", "max_in_flight 2 on each (split three ways)"),
                    ("r3-skew-cap-fleet", "max_in_flight 6 for the fleet (scope fleet)")):
    REPLICA_CONFIGS[_key] = (3, "skew", "fleet" in REPLICA_CAPS[_key])
    CONFIG_NAMES[_key] = f"3 Envoys, clients 60/30/10, {_what}"

# The fleet storm (issue 21): the provider's budget on one key, 30 requests per 20 s window and
# 60,000 tokens a minute, written as the gateway's limits three ways. Local limits are buckets
# of a per-minute rate (burst: one window's worth); fleet limits are the service's fixed windows
# of the provider's own length (the limits file below).
FLEET_RPM, FLEET_WINDOW_S, FLEET_TPM = 90, 20, 60_000
FLEET_WEIGHTS = (60, 30, 10)


def fleet_limits(scope: str, share: int = 1) -> list:
    return [
        {"name": "key-rpm", "key": "account", "requests_per_minute": FLEET_RPM // share,
         "burst": FLEET_RPM * FLEET_WINDOW_S // 60 // share, "scope": scope},
        {"name": "key-tpm", "key": "account", "tokens_per_minute": FLEET_TPM // share, "scope": scope},
    ]


FLEET_CONFIGS = {
    "x-once": {"pools": POOLS, "limits": fleet_limits("local")},
    "x-split": {"pools": POOLS, "limits": fleet_limits("local", share=3)},
    "x-fleet": {"pools": POOLS, "fleet": {"cluster": "llm_governor_ratelimit", "timeout_ms": 100},
                "limits": fleet_limits("fleet")},
}
# Issue 31, item 5: the provider's own window in the limits file, and the fleet's cooldowns
# shared (`fleet.cooldowns`): a provider answer that says its window is spent cools the fleet.
FLEET_CONFIGS["x-fleet-c"] = dict(FLEET_CONFIGS["x-fleet"], fleet=dict(FLEET_CONFIGS["x-fleet"]["fleet"],
                                                                      cooldowns=True))
FLEET_CONFIGS["x-fleet-m"] = FLEET_CONFIGS["x-fleet"]
FLEET_CONFIGS["x-fleet-free"] = FLEET_CONFIGS["x-fleet"]


def fleet_limits_file(margin_s: int = 0, scale: int = 1) -> str:
    """The service's limits: the provider's numbers (times `scale`), the request window
    `margin_s` longer."""
    return "".join(
        f"- namespace: llm_governor\n  name: {name}\n  max_value: {value}\n  seconds: {seconds}\n"
        f"  conditions: [\"descriptors[0]['limit'] == '{name}'\"]\n  variables: [\"descriptors[0]['key']\"]\n"
        for name, value, seconds in (("key-rpm", scale * FLEET_RPM * FLEET_WINDOW_S // 60, FLEET_WINDOW_S + margin_s),
                                     ("key-tpm", scale * FLEET_TPM, 60))
    )


class GatewayUnavailable(RuntimeError):
    pass


class Gateway:
    key = ""
    artifact: Optional[str] = None  # "wasm" or "native" for llm-governor's configurations
    # What a "tenants" client adds to every request body, by tenant (None: nothing).
    extra_body = None

    @property
    def name(self) -> str:
        return CONFIG_NAMES[self.key]

    def base_url(self) -> str:
        raise NotImplementedError

    def client_key(self, fresh: str) -> str:
        """The key clients send (a fresh one per run unless the gateway needs its own)."""
        return fresh

    def upstream_key(self, client_key: str) -> str:
        """The key the provider sees for a client key."""
        return client_key

    def backup_key(self) -> Optional[str]:
        """The key the second provider sees (None: this configuration never sends it anything)."""
        return None

    def start(self) -> "Gateway":
        return self

    def client_urls(self, clients: int):
        """Where each of `clients` clients sends: the one base URL, or (a fleet whose clients are
        pinned to replicas) a list, one per client."""
        return self.base_url()

    def stop(self) -> None:
        pass

    def info(self) -> dict:
        return {}


class Direct(Gateway):
    key = "a"

    def __init__(self, sim: Simulator):
        self.sim = sim

    def base_url(self) -> str:
        return self.sim.url + "/v1"


def retry_bootstrap(upstream_port: int, rate_limited_back_off: bool) -> dict:
    """The harness's bootstrap (no wasm filter) with a route retry policy on 429: (b) and (c)."""
    boot = envoy_bootstrap(upstream_port, [])
    policy: dict = {"retry_on": "retriable-status-codes", "retriable_status_codes": [429], "num_retries": 3}
    if rate_limited_back_off:
        policy["rate_limited_retry_back_off"] = {
            "reset_headers": [
                {"name": "retry-after", "format": "SECONDS"},
                {"name": "x-ratelimit-reset", "format": "UNIX_TIMESTAMP"},
            ],
            "max_interval": "10s",
        }
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["retry_policy"] = policy
    return boot


class EnvoyGateway(Gateway):
    """(b), (c): Envoy with a retry policy; (e), (e-cap), (e-tpm), (e-tpm-resv), (e-tpm-after), (f),
    (g): Envoy with llm-governor;
    (e-fo): llm-governor with a fallback pool on a second cluster (needs `backup`)."""

    def __init__(self, key: str, sim: Simulator, concurrency: int = 2, backup: Optional[Simulator] = None,
                 artifact: Optional[str] = None):
        self.key = key
        self.artifact = artifact_of(artifact) if governed(key) else None
        self.has_backup = key in FAILOVER_CONFIGS
        if self.has_backup:
            if backup is None:
                raise ValueError(f"({key}) needs a second simulator")
            # The harness's, as envoy/failover.yaml routes it (the backup's key injected).
            boot = failover_bootstrap(sim.port, backup.port, FAILOVER_CONFIGS[key], backup_key=BACKUP_KEY,
                                      artifact=self.artifact)
            self.envoy = Envoy(None, upstream_port=sim.port, concurrency=concurrency, bootstrap=boot,
                               artifact=self.artifact)
        elif key in GOVERNOR_CONFIGS:
            self.envoy = Envoy(GOVERNOR_CONFIGS[key], upstream_port=sim.port, concurrency=concurrency,
                               artifact=self.artifact)
        else:
            boot = retry_bootstrap(sim.port, rate_limited_back_off=(key == "c"))
            self.envoy = Envoy(None, upstream_port=sim.port, concurrency=concurrency, bootstrap=boot)

    def start(self) -> "EnvoyGateway":
        try:
            self.envoy.start()
        except HarnessError as err:
            raise GatewayUnavailable(str(err)) from err
        return self

    def stop(self) -> None:
        try:
            self.envoy.stop(check=True)
        finally:
            self.envoy.cleanup()

    def base_url(self) -> str:
        return self.envoy.url + "/v1"

    def backup_key(self) -> Optional[str]:
        return BACKUP_KEY if self.has_backup else None

    def info(self) -> dict:
        """Counters so far (run.py reports what one storm added); the fallback pool's and
        cluster's prefixed `backup.`."""
        stats = self.envoy.stats()
        governor = self.envoy.governor_stats()  # by wasm name, for either artifact
        out: dict = {}
        for pool, label in (("openai", ""), ("openai-backup", "backup."), ("anthropic", "")):
            prefix = f"wasmcustom.llm_governor.pool.{pool}."
            for k, v in governor.items():
                if k.startswith(prefix) and isinstance(v, int) and not k[len(prefix):].startswith(GAUGES):
                    out[label + k[len(prefix):]] = out.get(label + k[len(prefix):], 0) + v
        # The prediction errors' medians (issue 32), from the histograms' cumulative quantiles.
        for name, h in stats.items():
            for which in ("input_prediction_error_pct", "output_prediction_error_pct"):
                if which in name and isinstance(h, dict) and "anthropic" in name:
                    out[which + "_p50"] = histogram_p50(h)
        out["upstream_rq_retry"] = stats.get("cluster.provider.upstream_rq_retry", 0)
        out["upstream_rq_total"] = stats.get("cluster.provider.upstream_rq_total", 0)
        if self.has_backup:
            out["backup.upstream_rq_total"] = stats.get("cluster.backup.upstream_rq_total", 0)
        return out


def histogram_p50(h: dict) -> Optional[float]:
    """The cumulative median of an Envoy histogram in the admin API's JSON (quantile 0.5)."""
    values = h.get("values") or []
    return values[2].get("cumulative") if len(values) > 2 else None


class LiteLLMGateway(Gateway):
    """LiteLLM's proxy (bench/.venv-litellm), one deployment, num_retries: 3; (d-cap) adds the
    deployment's `litellm_params.max_parallel_requests` (LiteLLM 1.108.7 answers a call that
    finds every slot taken with its own 429, router_utils/client_initalization_utils.py).

    (d-fo): two deployments under one `model_name`, the second provider with its own key, and
    LiteLLM's defaults otherwise: `simple-shuffle` picks a deployment at random for each call;
    with more than one deployment in the group a 429 cools that deployment at once
    (router_utils/cooldown_handlers.py `_should_cooldown_deployment`) for the response's
    retry-after, else `cooldown_time` (default 5 s, DEFAULT_COOLDOWN_TIME_SECONDS); a retry
    sleeps 0 while the group has a deployment not cooling (router.py `_time_to_sleep_before_retry`),
    and a call that finds every deployment cooling fails with LiteLLM's own 429."""

    UPSTREAM_KEY = "sk-storm-litellm"
    BACKUP_KEY = "sk-storm-litellm-backup"

    def __init__(self, key: str, sim: Simulator, ready_timeout_s: float = 90.0, backup: Optional[Simulator] = None,
                 deployment: Optional[dict] = None, router_settings: Optional[dict] = None,
                 master_key: Optional[str] = None):
        """deployment: more `litellm_params` of the (first) deployment; router_settings: more
        `router_settings`; master_key: the key clients present (instances of one fleet share it)."""
        self.key = key
        self.sim = sim
        self.backup = backup if key == "d-fo" else None
        if key == "d-fo" and backup is None:
            raise ValueError(f"({key}) needs a second simulator")
        self.max_parallel = LITELLM_MAX_PARALLEL.get(key)
        self.deployment = dict(deployment or {})
        self.router_settings = dict(router_settings or {})
        if key == "d-prio":
            # LiteLLM's scheduler (docs/scheduler.md): a request with `priority` in its body
            # waits in the model group's queue, polled every polling_interval, until a
            # deployment is healthy or it tops the queue (lower goes first). The deployment
            # states the provider's rate (10 per 2 s) so the router can know it is full.
            self.deployment.setdefault("rpm", 300)
            self.router_settings.setdefault("polling_interval", 0.03)
            self.extra_body = lambda tenant: {"priority": tenant.priority}
        self.ready_timeout_s = ready_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.workdir = Path(tempfile.mkdtemp(prefix="storm-litellm-"))
        self.log_path = self.workdir / "litellm.log"
        # LiteLLM refuses to start without a master key; clients present it.
        self.master_key = master_key or "sk-storm-master-" + uuid.uuid4().hex

    def client_key(self, fresh: str) -> str:
        return self.master_key

    def upstream_key(self, client_key: str) -> str:
        return self.UPSTREAM_KEY

    def backup_key(self) -> Optional[str]:
        return self.BACKUP_KEY if self.backup is not None else None

    def config(self) -> dict:
        params = {"model": f"openai/{MODEL}", "api_base": self.sim.url + "/v1", "api_key": self.UPSTREAM_KEY}
        if self.max_parallel is not None:
            params["max_parallel_requests"] = self.max_parallel
        params.update(self.deployment)
        model_list = [{"model_name": MODEL, "litellm_params": params}]
        if self.backup is not None:
            model_list.append({"model_name": MODEL, "litellm_params": {
                "model": f"openai/{MODEL}", "api_base": self.backup.url + "/v1", "api_key": self.BACKUP_KEY}})
        return {
            "model_list": model_list,
            "litellm_settings": {"num_retries": 3, "request_timeout": 30, "telemetry": False},
            "router_settings": {"num_retries": 3, **self.router_settings},
            "general_settings": {"master_key": self.master_key},
        }

    def start(self) -> "LiteLLMGateway":
        exe = LITELLM_VENV / "bin" / "litellm"
        if not exe.exists():
            raise GatewayUnavailable(f"{exe} missing: run bench/storm/ensure-litellm.sh")
        config = self.workdir / "litellm.yaml"
        config.write_text(json.dumps(self.config(), indent=1))  # JSON is YAML
        self.port = free_port()
        env = dict(os.environ)
        env.update({
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no fetch of the cost map
            "LITELLM_TELEMETRY": "False",
            "DISABLE_SCHEMA_UPDATE": "True",
            "NO_DOCS": "True",
        })
        env.pop("DATABASE_URL", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port),
                 "--num_workers", "1"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        if not wait_http_ok(f"http://127.0.0.1:{self.port}/health/liveliness", deadline, self.proc):
            exited, tail = self.proc.poll(), self.log_tail()
            self.stop()
            state = f"exited with {exited}" if exited is not None else f"not ready after {self.ready_timeout_s:.0f}s"
            raise GatewayUnavailable(f"LiteLLM {state}:\n{tail}")
        return self

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        terminate(self.proc, grace_s=10)
        if not os.environ.get("LLM_GOVERNOR_KEEP_LOGS"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def info(self) -> dict:
        return {"version": litellm_version()}


def litellm_version() -> str:
    py = LITELLM_VENV / "bin" / "python"
    if not py.exists():
        return ""
    out = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


class FleetGateway(Gateway):
    """(x-once), (x-split), (x-fleet), (x-fleet-m): three Envoys with llm-governor behind a fourth Envoy that
    balances 60/30/10 (weighted clusters); for (x-fleet) a Redis and two Limitador-compatible
    services on it (integration/limitador-rls), Envoys 1 and 3 asking one, Envoy 2 the other."""

    def __init__(self, key: str, sim: Simulator, artifact: Optional[str] = None):
        from fleet_rig import TURN_SERVICE_ARGS, Redis, RlsService, fleet_envoy, turn_limit

        self.key = key
        self.artifact = artifact_of(artifact)
        self.sim = sim
        self.config = FLEET_CONFIGS[key]
        self.redis = Redis() if key.startswith("x-fleet") else None
        self.limits = fleet_limits_file(margin_s=1 if key == "x-fleet-m" else 0,
                                        scale=100 if key == "x-fleet-free" else 1)
        cooldowns = self.config.get("fleet", {}).get("cooldowns", False)
        self.service_args = TURN_SERVICE_ARGS if cooldowns else []
        if cooldowns:
            self.limits += turn_limit("llm_governor")
        self.services: list = []
        self.replicas: list = []
        self.lb: Optional[Envoy] = None
        self._make = (RlsService, fleet_envoy)

    def start(self) -> "FleetGateway":
        RlsService, fleet_envoy = self._make
        try:
            if self.redis is not None:
                self.redis.start()
                self.services = [RlsService(self.redis, self.limits, self.service_args).start() for _ in range(2)]
                ports = [self.services[i % 2].port for i in range(3)]
                self.replicas = [fleet_envoy(self.config, self.sim.port, p, concurrency=1,
                                             artifact=self.artifact).start() for p in ports]
            else:
                self.replicas = [Envoy(self.config, upstream_port=self.sim.port, concurrency=1,
                                       artifact=self.artifact).start() for _ in range(3)]
            self.lb = Envoy(None, upstream_port=self.sim.port, concurrency=1,
                            bootstrap=lb_bootstrap([e.port for e in self.replicas])).start()
        except HarnessError as err:
            self.stop()
            raise GatewayUnavailable(str(err)) from err
        return self

    def stop(self) -> None:
        for e in self.replicas + ([self.lb] if self.lb else []):
            e.stop(check=False)
            e.cleanup()
        for s in self.services:
            s.cleanup()
        if self.redis is not None:
            self.redis.cleanup()

    def base_url(self) -> str:
        assert self.lb is not None
        return self.lb.url + "/v1"

    def info(self) -> dict:
        out: dict = {}
        prefix = "wasmcustom.llm_governor.pool.openai."
        for i, e in enumerate(self.replicas):
            if not e.running:
                continue
            stats = e.stats()
            for k, v in e.governor_stats().items():  # by wasm name, for either artifact
                if k.startswith(prefix) and isinstance(v, int) and not k[len(prefix):].startswith(GAUGES):
                    out[k[len(prefix):]] = out.get(k[len(prefix):], 0) + v
            n = stats.get("cluster.provider.upstream_rq_total", 0)
            out[f"replica{i + 1}.upstream_rq_total"] = n
            out["upstream_rq_total"] = out.get("upstream_rq_total", 0) + n
        return out


class LiteLLMProxies(Gateway):
    """Three LiteLLM proxies (num_retries 3, as (d)) on one Redis, which `router` names (and
    `deployment`'s rpm/tpm, when given): what (x-litellm) and (r3-litellm) share."""

    def __init__(self, key: str, sim: Simulator, router: dict, deployment: Optional[dict] = None):
        from fleet_rig import Redis

        self.key = key
        self.sim = sim
        # The proxies' configuration names Redis's port before it starts: chosen now, kept.
        self.redis = Redis(port=free_port())
        master = "sk-storm-master-" + uuid.uuid4().hex
        router = {**router, "redis_host": "127.0.0.1", "redis_port": self.redis.port}
        self.proxies = [LiteLLMGateway("d", sim, deployment=deployment, router_settings=router, master_key=master)
                        for _ in range(3)]

    def client_key(self, fresh: str) -> str:
        return self.proxies[0].master_key

    def upstream_key(self, client_key: str) -> str:
        return LiteLLMGateway.UPSTREAM_KEY

    def start(self) -> "LiteLLMProxies":
        try:
            self.redis.start()
            for p in self.proxies:
                p.start()
            self.started()
        except (HarnessError, GatewayUnavailable) as err:
            self.stop()
            raise GatewayUnavailable(str(err)) from err
        return self

    def started(self) -> None:
        """What starts once the proxies run (nothing, here)."""

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()
        self.redis.cleanup()

    def info(self) -> dict:
        return {"version": litellm_version()}


class LiteLLMFleetGateway(LiteLLMProxies):
    """(x-litellm): three LiteLLM proxies (one worker each) behind the same 60/30/10 Envoy
    balancer as the Envoy fleet, sharing one Redis the way LiteLLM's docs say to share a
    deployment's rpm/tpm across instances: `router_settings.redis_host` / `redis_port` and the
    deployment's `rpm` and `tpm` (litellm_params). The provider allows 30 requests per 20 s;
    LiteLLM counts rpm per clock minute (router_strategy/lowest_tpm_rpm_v2.py keys its counters
    `<id>:<model>:rpm:%H-%M`), so the deployment gets the same rate per minute, 90, and the
    provider's 60,000 tpm. The counters are enforced before a call by `usage-based-routing-v2`
    (its `async_pre_call_check` increments the Redis counter and raises a 429 over the limit);
    the default `simple-shuffle` only uses rpm/tpm as weights. num_retries: 3 as in (d)."""

    key = "x-litellm"

    def __init__(self, key: str, sim: Simulator):
        super().__init__(key, sim, {"routing_strategy": "usage-based-routing-v2"},
                         {"rpm": FLEET_RPM, "tpm": FLEET_TPM})
        self.lb: Optional[Envoy] = None

    def started(self) -> None:
        self.lb = Envoy(None, upstream_port=self.sim.port, concurrency=1,
                        bootstrap=lb_bootstrap([p.port for p in self.proxies])).start()

    def stop(self) -> None:
        if self.lb is not None:
            self.lb.stop(check=False)
            self.lb.cleanup()
        super().stop()

    def base_url(self) -> str:
        assert self.lb is not None
        return self.lb.url + "/v1"


def lb_bootstrap(ports: list) -> dict:
    """An Envoy that spreads requests over `ports` by FLEET_WEIGHTS (weighted clusters)."""
    boot = envoy_bootstrap(ports[0], [])
    names = [f"replica{i + 1}" for i in range(len(ports))]
    boot["static_resources"]["clusters"] = [
        {"name": n, "type": "STATIC", "connect_timeout": "2s",
         "load_assignment": {"cluster_name": n, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
             "socket_address": {"address": "127.0.0.1", "port_value": p}}}}]}]}}
        for n, p in zip(names, ports)
    ]
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    route.pop("cluster")
    route["weighted_clusters"] = {"clusters": [{"name": n, "weight": w} for n, w in zip(names, FLEET_WEIGHTS)]}
    return boot


class LiteLLMAgents(Gateway):
    """(d-agents): LiteLLM's input/output token limiter in front of Anthropic's /v1/messages.
    Not wired: reported as not run, with the reason."""

    key = "d-agents"

    def start(self) -> "LiteLLMAgents":
        if not (LITELLM_VENV / "bin" / "litellm").exists():
            raise GatewayUnavailable("LiteLLM is not installed here (bench/.venv-litellm)")
        raise GatewayUnavailable("LiteLLM's per-dimension limiter for Anthropic's /v1/messages is not wired yet")


def governed(key: str) -> bool:
    """Whether configuration `key` runs llm-governor (and so has an artifact)."""
    return key in GOVERNOR_CONFIGS or key in FAILOVER_CONFIGS or key in FLEET_CONFIGS or key in REPLICA_CONFIGS


def pinned(clients: int, replicas: int, weights=None) -> list:
    """Which replica each client talks to: evenly (7/7/6), or by `weights` (12/6/2)."""
    weights = weights or (1,) * replicas
    total = sum(weights)
    shares = [clients * w // total for w in weights]
    for i in range(clients - sum(shares)):
        shares[i % replicas] += 1
    return [r for r, n in enumerate(shares) for _ in range(n)]


class ReplicaGateway(Gateway):
    """(r*): N Envoys (2 workers each) with llm-governor, each client pinned to one; for (r*-fleet)
    and (r3-skew-cap-fleet) a Redis and two Limitador-compatible services on it, the replicas
    asking them in turn."""

    def __init__(self, key: str, sim: Simulator, artifact: Optional[str] = None):
        self.key = key
        self.artifact = artifact_of(artifact)
        self.sim = sim
        self.n, split, self.fleet = REPLICA_CONFIGS[key]
        self.weights = REPLICA_SPLITS[split]
        self.config = REPLICA_CAPS.get(key) or {"pools": POOLS}
        if self.fleet and key not in REPLICA_CAPS:
            self.config["fleet"] = {"cluster": "llm_governor_ratelimit", "timeout_ms": 100, "cooldowns": True}
        self.redis = None
        self.services: list = []
        self.replicas: list = []

    def start(self) -> "ReplicaGateway":
        from fleet_rig import TURN_SERVICE_ARGS, Redis, RlsService, fleet_envoy, limits_file

        try:
            if self.fleet:
                self.redis = Redis().start()
                self.services = [RlsService(self.redis, limits_file(self.config), TURN_SERVICE_ARGS).start()
                                 for _ in range(2)]
                self.replicas = [fleet_envoy(self.config, self.sim.port, self.services[i % 2].port,
                                             concurrency=2, artifact=self.artifact).start()
                                 for i in range(self.n)]
            else:
                self.replicas = [Envoy(self.config, upstream_port=self.sim.port, concurrency=2,
                                       artifact=self.artifact).start() for _ in range(self.n)]
        except HarnessError as err:
            self.stop()
            raise GatewayUnavailable(str(err)) from err
        return self

    def stop(self) -> None:
        for e in self.replicas:
            e.stop(check=False)
            e.cleanup()
        for svc in self.services:
            svc.cleanup()
        if self.redis is not None:
            self.redis.cleanup()

    def base_url(self) -> str:
        return self.replicas[0].url + "/v1"

    def client_urls(self, clients: int):
        return [self.replicas[r].url + "/v1" for r in pinned(clients, self.n, self.weights)]

    def info(self) -> dict:
        out: dict = {}
        prefix = "wasmcustom.llm_governor.pool.openai."
        for i, e in enumerate(self.replicas):
            if not e.running:
                continue
            stats = e.stats()
            for k, v in e.governor_stats().items():
                if k.startswith(prefix) and isinstance(v, int) and not k[len(prefix):].startswith(GAUGES):
                    out[k[len(prefix):]] = out.get(k[len(prefix):], 0) + v
            n = stats.get("cluster.provider.upstream_rq_total", 0)
            out[f"replica{i + 1}.upstream_rq_total"] = n
            out["upstream_rq_total"] = out.get("upstream_rq_total", 0) + n
        return out


class LiteLLMPinnedGateway(LiteLLMProxies):
    """(r3-litellm): three LiteLLM proxies (num_retries 3) on one Redis (cooldowns shared the way
    LiteLLM's docs say), each client pinned to one."""

    def __init__(self, key: str, sim: Simulator):
        super().__init__(key, sim, {})

    def base_url(self) -> str:
        return self.proxies[0].base_url()

    def client_urls(self, clients: int):
        return [self.proxies[r].base_url() for r in pinned(clients, 3)]


def make_gateway(key: str, sim: Simulator, concurrency: int = 2, backup: Optional[Simulator] = None,
                 artifact: Optional[str] = None) -> Gateway:
    """backup: the second provider, needed by (e-fo) and (d-fo) and ignored by the others;
    artifact: llm-governor's ("wasm" or "native"; None: LLM_GOVERNOR_ARTIFACT's), ignored by the
    configurations without it."""
    if key not in CONFIG_NAMES:
        raise ValueError(f"unknown configuration {key!r}: one of {', '.join(CONFIG_NAMES)}")
    if key == "a":
        return Direct(sim)
    if key == "x-litellm":
        return LiteLLMFleetGateway(key, sim)
    if key == "d-agents":
        return LiteLLMAgents()
    if key == "r3-litellm":
        return LiteLLMPinnedGateway(key, sim)
    if key in REPLICA_CONFIGS:
        return ReplicaGateway(key, sim, artifact=artifact)
    if key in FLEET_CONFIGS:
        return FleetGateway(key, sim, artifact=artifact)
    if key in LITELLM_MAX_PARALLEL:
        return LiteLLMGateway(key, sim, backup=backup)
    return EnvoyGateway(key, sim, concurrency, backup=backup, artifact=artifact)
