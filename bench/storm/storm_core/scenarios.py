"""Storm scenarios: what the provider does (simulator scenarios, posted in phases), how many
clients call, how often, and through which gateway configurations. A failover storm (issue 9)
also says what a second provider does (`backup_phases`, a second simulator)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

MODEL = "gpt-4o-mini"
MESSAGES = [{"role": "user", "content": "hi"}]

# Configurations by letter (gateways.py builds them). (e) and (g) are the same filter with hold
# on and off, next to each other in every table.
ALL_CONFIGS = ("a", "b", "c", "d", "e", "g", "f")


@dataclass
class Phase:
    """One simulator scenario, posted `at_ms` after t = 0 (the first at t = 0, with the clients)."""

    scenario: dict
    at_ms: float = 0.0


# In a phase's scenario, this string (anywhere in a list or as a value) stands for the key the
# provider sees for the run's clients (fresh per run for the filter, the configured one behind
# LiteLLM): `{"mode": "quota", "keys": [UPSTREAM_KEY]}` caps that key and no other.
UPSTREAM_KEY = "$UPSTREAM_KEY"


def resolve(scenario, upstream_key: str):
    """The scenario with every UPSTREAM_KEY replaced by the run's upstream key."""
    if isinstance(scenario, dict):
        return {k: resolve(v, upstream_key) for k, v in scenario.items()}
    if isinstance(scenario, list):
        return [resolve(v, upstream_key) for v in scenario]
    return upstream_key if scenario == UPSTREAM_KEY else scenario


@dataclass
class Storm:
    name: str
    title: str
    clients: int
    phases: list
    # Calls each client makes, one after the other.
    calls_per_client: int = 1
    # "sdk": the openai SDK with max_retries=3 and its own schedule.
    # "fixed": the published Strategy C schedule. "obey": retry-after-ms as the SDKs read it.
    # "loop": the openai SDK with its default max_retries, each client calling again and again
    # until `duration_s` (calls_per_client is then 0: the number of calls is what fits).
    client_kind: str = "sdk"
    max_attempts: int = 4
    budget_ms: Optional[float] = None
    # The provider recovers `recovers_after_ms` into phase `recovers_in_phase` (its scenario
    # clock), for "first success after recovery" and the replay's throttled window.
    recovers_in_phase: Optional[int] = None
    recovers_after_ms: float = 0.0
    # The earliest the last call can possibly complete (for "p99 / schedule minimum").
    schedule_min_ms: Optional[float] = None
    configs: tuple = ALL_CONFIGS
    seed: int = 107
    run_timeout_s: float = 45.0
    # A second provider (issue 9): its phases, posted like `phases` to a second simulator. None:
    # one provider. A configuration without a fallback never sends it anything.
    backup_phases: Optional[list] = None
    # Start every gateway fresh for this storm alone: a fallback's account is a fixed label
    # (the filter's `account`, LiteLLM's deployment key), so its cooldown or pace from the
    # storm before would carry over into this one.
    fresh_gateway: bool = False
    # "loop" clients: how long they keep starting calls and the prompt's length in characters
    # (varied by up to 5 % per request).
    duration_s: float = 0.0
    prompt_chars: int = 0
    # The output limit each call sends ("loop" and "sdk" clients; None: none).
    max_tokens: Optional[int] = None
    # The provider's token-per-minute limit on the key (simulator scenario `tpm`), for the
    # budget the TPM figures compare against.
    tpm_tokens: Optional[int] = None
    # "sdk" clients: client i starts i/clients of this many ms after t = 0 (0: all at once).
    start_spread_ms: float = 0.0
    # "agents" clients (issue 32): the shared system prompt's length in characters, and the
    # provider's input and output tokens per minute on the key (for "what the provider admits").
    system_chars: int = 0
    itpm_tokens: Optional[int] = None
    otpm_tokens: Optional[int] = None
    # "tenants" clients: groups of SDK clients of one account, each group with its own headers,
    # timeout and pause between calls, all calling in a loop until `duration_s` (issue 33).
    tenants: tuple = ()
    # The fleet-cap storm (issue 31): the provider's concurrency limit on the key, for the
    # throughput the cap lets through (that many answers every latency).
    cap: Optional[int] = None

    @property
    def calls(self) -> int:
        return self.clients * self.calls_per_client


ISSUE3_LIMIT = {"requests": 5, "window_ms": 3000}
# 20 calls, 5 per 3 s window: the last 5 can only succeed in the fourth window, 9 s after t = 0.
ISSUE3_SCHEDULE_MIN_MS = (20 // ISSUE3_LIMIT["requests"] - 1) * ISSUE3_LIMIT["window_ms"]

ISSUE3 = Storm(
    name="issue3",
    title="issue 3: 20 SDK clients, limit 5 req / 3 s (rejected count), one key",
    clients=20,
    phases=[Phase({"limit": ISSUE3_LIMIT})],
    schedule_min_ms=ISSUE3_SCHEDULE_MIN_MS,
)

# The same storm with the hint also in `retry-after-ms` (as Azure OpenAI sends it).
ISSUE3_MS = Storm(
    name="issue3-ms",
    title="issue 3, provider hint also in retry-after-ms: 20 SDK clients, limit 5 req / 3 s, one key",
    clients=20,
    phases=[Phase({"limit": ISSUE3_LIMIT, "retry_after": "both"})],
    schedule_min_ms=ISSUE3_SCHEDULE_MIN_MS,
)

# A sustained 429 window, then a request limit: the provider answers every request with 429
# and `retry-after: 1` for 2.5 s (it under-states how long it stays down), then admits 10
# requests per 2 s window, counting rejected ones.
ISSUE5 = Storm(
    name="issue5",
    title="issue 5: 20 SDK clients, 429 for 2.5 s (retry-after: 1), then limit 10 req / 2 s",
    clients=20,
    phases=[
        Phase({"mode": "rate_limited", "retry_after_s": 1.0, "until_ms": 10_000}),
        Phase({"limit": {"requests": 10, "window_ms": 2000}}, at_ms=2500),
    ],
    recovers_in_phase=1,
)

# Issue 20: the issue-5 storm with a provider that under-states every wait, during the outage
# and after it: each 429 says `retry-after: 1` (and a 1 s reset) whatever the window says, while
# its successes report the truth (`x-ratelimit-remaining-requests`, `-reset-requests`: the
# requests left in the 10 / 2 s window, rejected ones counted, and when its oldest leaves). The
# 20 SDK clients start over the first second (workers coming up), as in the outside run.
ISSUE20 = Storm(
    name="issue20",
    title="issue 20: 20 SDK clients over 1 s, 429 for 2.5 s, then limit 10 req / 2 s; every 429 says retry-after: 1",
    clients=20,
    start_spread_ms=1000.0,
    phases=[
        Phase({"mode": "rate_limited", "retry_after_s": 1.0, "until_ms": 10_000}),
        Phase({"limit": {"requests": 10, "window_ms": 2000}, "retry_after_s": 1.0}, at_ms=2500),
    ],
    recovers_in_phase=1,
)

# The same with every client at t = 0, as in the issue-5 storm: the first wave is all 20.
ISSUE20_BURST = dataclasses.replace(
    ISSUE20,
    name="issue20-burst",
    title="issue 20, all 20 SDK clients at t = 0: 429 for 2.5 s, then 10 req / 2 s; every 429 says retry-after: 1",
    start_spread_ms=0.0,
)

# The overnight storm: a provider that serves at most 10 requests of a key at once (300 ms
# each) and answers 429 beyond; 30 SDK clients make 2 calls each, one after the other.
OVERNIGHT = Storm(
    name="overnight",
    title="overnight: 30 SDK clients x 2 calls, provider allows 10 in flight per key (300 ms each)",
    clients=30,
    calls_per_client=2,
    phases=[Phase({"max_concurrency": 10, "latency_ms": 300})],
    configs=("e-cap", "e", "g", "a", "d-cap", "d"),
)


# Failover (issue 9): configurations (e) llm-governor with one provider (no fallback), (e-fo)
# llm-governor with a fallback pool routed to the second provider, (d-fo) LiteLLM with the two
# providers as two deployments of one model name (gateways.py).
FAILOVER_CONFIGS = ("e", "e-fo", "d-fo")

# The issue-3 storm, now with a second provider behind the same model, limited the same way
# (5 requests / 3 s sliding window, rejected ones counted, each provider on its own key).
# Together they admit 10 per window: 20 calls can all complete in the second window, 3 s after
# t = 0 (one provider alone: the fourth, 9 s).
ISSUE3_FAILOVER = Storm(
    name="issue3-failover",
    title="issue 3 with a second provider: 20 SDK clients, each provider 5 req / 3 s (rejected count)",
    clients=20,
    phases=[Phase({"limit": ISSUE3_LIMIT})],
    backup_phases=[Phase({"limit": ISSUE3_LIMIT})],
    configs=FAILOVER_CONFIGS,
    fresh_gateway=True,
)

# A spend cap on the primary: every request of the run's key gets OpenAI's 429
# `insufficient_quota` (no retry hint); the second provider serves everything. Two variants:
# 20 calls one after the other by one SDK client (after the first call, the gateway knows the
# cap: the capped primary should see exactly one request), and 20 SDK clients at once (the
# first wave meets the cap cold, 20 requests, before any answer is back).
SPENDCAP_QUOTA = {"mode": "quota", "keys": [UPSTREAM_KEY]}
SPENDCAP_FAILOVER = Storm(
    name="spendcap-failover",
    title="spend cap on the primary (insufficient_quota), backup fine: 1 SDK client x 20 sequential calls",
    clients=1,
    calls_per_client=20,
    phases=[Phase(SPENDCAP_QUOTA)],
    backup_phases=[Phase({"mode": "ok"})],
    configs=FAILOVER_CONFIGS,
    fresh_gateway=True,
)
SPENDCAP_FAILOVER_STORM = Storm(
    name="spendcap-failover-storm",
    title="spend cap on the primary (insufficient_quota), backup fine: 20 SDK clients at once",
    clients=20,
    phases=[Phase(SPENDCAP_QUOTA)],
    backup_phases=[Phase({"mode": "ok"})],
    configs=FAILOVER_CONFIGS,
    fresh_gateway=True,
)


# Token limits (issue 12): the provider allows 20,000 tokens per minute on the key, counting
# each request at admission as its input estimate + max_tokens (the simulator's `tpm`, as
# OpenAI documents it); the gateway's own limit is the same 20,000, reserving before the call and
# settling with the usage (e-tpm) or keeping the reservation (e-tpm-resv), or charging the
# reported usage after the response (e-tpm-after). 30 SDK clients call in a loop
# for 150 s with ~3,200-character prompts and max_tokens 200: about 1,000 tokens a call, so the
# budget is ~20 calls in the first minute and ~20 a minute after. The simulator answers with 5
# completion tokens (its default, min(5, max_tokens)): answers much shorter than max_tokens.
TPM_TOKENS = 20_000
TPM_CONFIGS = ("e-tpm-default", "e-tpm", "e-tpm-resv", "e-tpm-after", "a", "d")
TPM = Storm(
    name="tpm",
    title="TPM (issue 12): 30 SDK clients in a loop for 150 s, ~3,200-char prompts, max_tokens 200, "
          "provider 20,000 tokens/min on the key (input estimate + max_tokens), answers of 5 tokens",
    clients=30,
    phases=[Phase({"tpm": {"tokens": TPM_TOKENS}})],
    client_kind="loop",
    calls_per_client=0,
    duration_s=150.0,
    prompt_chars=3200,
    max_tokens=200,
    tpm_tokens=TPM_TOKENS,
    configs=TPM_CONFIGS,
    run_timeout_s=150.0 + 60.0,
    fresh_gateway=True,
)
# The same with answers that use all of max_tokens: the usage the provider reports is then
# what it counted at admission (up to its input estimate against the gateway's).
TPM_FULL = dataclasses.replace(
    TPM,
    name="tpm-full",
    title="TPM (issue 12), answers of max_tokens (200): 30 SDK clients in a loop for 150 s, "
          "~3,200-char prompts, provider 20,000 tokens/min on the key",
    phases=[Phase({"tpm": {"tokens": TPM_TOKENS}, "usage": {"output_tokens": 200}})],
    configs=("e-tpm-default", "e-tpm", "e-tpm-resv", "e-tpm-after"),  # (a), (d): no budget to settle
)


# Issue 21: a fleet of three Envoys behind an uneven load balancer (60/30/10) in front of one
# provider key that allows 30 requests per 20 s window (rejected ones counted) and 60,000 tokens
# a minute. 30 SDK clients make 3 calls each over 1 s: 90 calls need at least three windows.
# Each call sends `max_tokens: 64`, so the request window binds, as the schedule minimum says:
# without it each reservation holds the config's 1,024 default output tokens, 57 calls fit the
# token budget's minute, and the storm measures the gateway's own estimate instead (stop 28's
# tables, docs/benchmarks-history.md).
# (x-litellm): three LiteLLM proxies sharing the deployment's rpm/tpm on one Redis (issue 21, item 7).
FLEET_CONFIGS = ("x-once", "x-split", "x-fleet", "x-fleet-m", "x-fleet-c", "x-litellm")
FLEET = Storm(
    name="fleet",
    title="fleet (issue 21): 3 Envoys, LB 60/30/10, 30 SDK clients x 3 calls, provider 30 req / 20 s "
          "and 60,000 tokens/min on the key",
    clients=30,
    calls_per_client=3,
    start_spread_ms=1000.0,
    max_tokens=64,
    phases=[Phase({"limit": {"requests": 30, "window_ms": 20_000}, "tpm": {"tokens": 60_000}})],
    schedule_min_ms=2 * 20_000,
    configs=FLEET_CONFIGS,
    run_timeout_s=150.0,
    fresh_gateway=True,
)

# What cooldowns cost a fleet (they stay per Envoy: README "Fleet"): the issue-5 outage through
# the three Envoys, with fleet limits far above the provider's (only the cooldowns act). Each replica learns the
# cooldown from a 429 of its own: a provider round costs at most one probe per replica.
FLEET_COOLDOWN = Storm(
    name="fleet-cooldown",
    title="fleet cooldowns: 3 Envoys, LB 60/30/10, 20 SDK clients, 429 for 2.5 s (retry-after: 1), "
          "then limit 10 req / 2 s",
    clients=20,
    phases=[
        Phase({"mode": "rate_limited", "retry_after_s": 1.0, "until_ms": 10_000}),
        Phase({"limit": {"requests": 10, "window_ms": 2000}}, at_ms=2500),
    ],
    recovers_in_phase=1,
    configs=("x-fleet-free",),
    fresh_gateway=True,
)


# Issue 32: coding agents against a provider that counts as Anthropic documents. 12 agents on the
# official Anthropic SDK (its own retries), each a conversation: a shared system prompt of
# 40,000 characters (about 10,000 tokens as the provider counts them, bytes / 4) marked
# `cache_control`, the conversation so far with a breakpoint on its newest block, max_tokens
# 16,000; each turn adds the answer and a tool result of 400 to 1,200 characters, and a new task
# starts after 6 turns. The provider: Anthropic's published limits on the key, 20,000 input
# tokens a minute (uncached input + cache writes; cache reads free) and 6,000 output tokens a
# minute (tokens generated), token buckets refilled continuously; answers of 50 to 300 tokens
# after 1 s. 40 s per run.
AGENT_ITPM, AGENT_OTPM = 20_000, 6_000
AGENTS_CONFIGS = ("a", "e-agents-tpm", "e-agents-dims", "d-agents")
AGENTS = Storm(
    name="agents",
    title="agents (issue 32): 12 Anthropic SDK agents for 40 s, cached 10,000-token system prompt, "
          "max_tokens 16,000, answers of 50-300 tokens; provider 20,000 input / 6,000 output tokens per minute",
    clients=12,
    phases=[Phase({"itpm": {"tokens": AGENT_ITPM}, "otpm": {"tokens": AGENT_OTPM},
                   "usage": {"output_tokens_range": [50, 300]}, "latency_ms": 1000})],
    client_kind="agents",
    calls_per_client=0,
    duration_s=40.0,
    system_chars=40_000,
    max_tokens=16_000,
    itpm_tokens=AGENT_ITPM,
    otpm_tokens=AGENT_OTPM,
    configs=AGENTS_CONFIGS,
    run_timeout_s=40.0 + 60.0,
    fresh_gateway=True,
)


@dataclass(frozen=True)
class Tenant:
    """A group of SDK clients behind one gateway, on the run's one account: `clients` of them,
    each calling again and again (its `think_s` pause after each answer, then the next call)
    with `x-tenant-id: <name>`, the SDK's `timeout_s` (sent as `x-stainless-timeout`) and its
    default retries. `priority` is what LiteLLM's scheduler is asked for (lower goes first)."""

    name: str
    clients: int
    timeout_s: float
    think_s: float = 0.0
    priority: int = 0


# Issue 33, "noisy neighbour": one account whose provider admits 10 requests per 2 s (a sliding
# window that counts rejected requests too, so 5 a second at most) and answers in 200 ms, a
# batch tenant of 40 SDK clients with long timeouts (the SDK's 600 s) calling back to back, and
# a chat tenant of 4 clients with 15 s timeouts, each reading its answer for a second before
# the next question. 40 s of calls; every figure per tenant, and the provider's admissions per
# second. The slow variant (500 ms answers) measures the pace alone.
NOISY_LIMIT = {"requests": 10, "window_ms": 2000}
# A provider answers in 200 ms (a short completion); the slow variant in 500 ms.
NOISY_LATENCY_MS = 200
NOISY_CONFIGS = ("e", "e-fair", "e-classes", "d-prio")
NOISY = Storm(
    name="noisy-neighbour",
    title="noisy neighbour (issue 33): one account, provider 10 req / 2 s; batch 40 SDK clients "
          "(600 s timeout) back to back, chat 4 SDK clients (15 s timeout, 1 s between calls); 40 s",
    clients=44,
    phases=[Phase({"limit": NOISY_LIMIT, "latency_ms": NOISY_LATENCY_MS})],
    client_kind="tenants",
    calls_per_client=0,
    duration_s=40.0,
    tenants=(Tenant("batch", 40, timeout_s=600.0, priority=1),
             Tenant("chat", 4, timeout_s=15.0, think_s=1.0, priority=0)),
    configs=NOISY_CONFIGS,
    run_timeout_s=40.0 + 60.0,
    fresh_gateway=True,
)


# Issue 31's outage, as a user meets it through replicas: 20 SDK clients starting over 1 s
# (workers coming up, as in the outside run), the provider
# down for 2.5 s answering `retry-after: 1` while its `x-ratelimit-reset-requests` tells the true
# rest of the outage, every request counted in its window (rejected ones, the outage's too),
# then 10 requests per 2 s. One scenario, so the window carries the outage's requests over.
OUTAGE_CONFIGS = ("r1", "r3", "r3-skew", "r6", "r1-fleet", "r3-fleet", "r3-skew-fleet", "r6-fleet", "r3-litellm")
OUTAGE = Storm(
    name="outage",
    title="outage (issue 31): 20 SDK clients over 1 s pinned to the replicas, 429 for 2.5 s (retry-after: 1, "
          "reset: the rest), then limit 10 req / 2 s, rejected requests counted",
    clients=20,
    start_spread_ms=1000.0,
    phases=[Phase({"mode": "rate_limited", "retry_after_s": 1.0, "down_until_ms": 2500,
                   "limit": {"requests": 10, "window_ms": 2000}})],
    recovers_in_phase=0,
    recovers_after_ms=2500,
    configs=OUTAGE_CONFIGS,
    fresh_gateway=True,
)


NOISY_SLOW = dataclasses.replace(
    NOISY,
    name="noisy-neighbour-slow",
    title="noisy neighbour, the provider answering in 500 ms: arrival order and fair key",
    phases=[Phase({"limit": NOISY_LIMIT, "latency_ms": 500})],
    configs=("e", "e-fair"),
)


# How close the fair key's shares are across Envoy's workers: two tenants that both always have
# requests waiting, a with 30 SDK clients, b with 3, back to back. Fair turns give each half of
# the provider's admissions (b's share: its completed calls over all); run with
# `--concurrency 1` (exact: one queue) and 2 (each worker's turns over its own requests).
FAIR_SHARE = Storm(
    name="fair-share",
    title="fair share: tenant a 30 SDK clients, tenant b 3, both back to back; provider 10 req / 2 s, 200 ms",
    clients=33,
    phases=[Phase({"limit": NOISY_LIMIT, "latency_ms": NOISY_LATENCY_MS})],
    client_kind="tenants",
    calls_per_client=0,
    duration_s=40.0,
    tenants=(Tenant("a", 30, timeout_s=600.0), Tenant("b", 3, timeout_s=600.0)),
    configs=("e", "e-fair"),
    run_timeout_s=40.0 + 60.0,
    fresh_gateway=True,
)


# Issue 31, item 7: one concurrency cap for the fleet. The provider takes at most 6 requests of
# the key at a time (a seventh is answered 429 and counted) and answers each after 500 ms; 30
# SDK clients (max_retries 3) pinned 60/30/10 over three Envoys of 2 workers, 6 calls each, back
# to back. The cap written once (6 on each Envoy: 18 in all), split three ways (2 each), and
# once for the fleet (`scope: "fleet"`, slots held on a Limitador-compatible service on Redis).
CAP_N, CAP_LATENCY_MS = 6, 500
FLEET_CAP_CONFIGS = ("r3-skew-cap-once", "r3-skew-cap-split", "r3-skew-cap-fleet")
FLEET_CAP = Storm(
    name="fleet-cap",
    title="fleet cap (issue 31): 30 SDK clients x 6 calls pinned 60/30/10 over 3 Envoys; the provider "
          "takes 6 at a time, 500 ms each",
    clients=30,
    calls_per_client=6,
    start_spread_ms=1000.0,
    phases=[Phase({"mode": "ok", "latency_ms": CAP_LATENCY_MS, "max_concurrency": CAP_N})],
    # 180 calls, 6 at a time, 500 ms each.
    schedule_min_ms=30 * 6 // CAP_N * CAP_LATENCY_MS,
    configs=FLEET_CAP_CONFIGS,
    run_timeout_s=120.0,
    fresh_gateway=True,
    cap=CAP_N,
)


def replay(client_kind: str, style: str) -> Storm:
    """The published replay: 120 clients at t = 0, every request 429 until 2,000 ms (the
    provider says 2 s), at most 4 attempts, 2,500 ms total budget."""
    schedule = "Strategy C fixed schedule" if client_kind == "fixed" else "clients obey retry-after-ms"
    return Storm(
        name=f"replay-{client_kind}-{style}",
        title=f"replay, {schedule}, provider hint in {style}",
        clients=120,
        phases=[Phase({"mode": "rate_limited", "until_ms": 2000, "retry_after": style, "retry_after_s": 2.0})],
        client_kind=client_kind,
        budget_ms=2500,
        recovers_in_phase=0,
        recovers_after_ms=2000,
        run_timeout_s=20,
    )


SCENARIOS = {
    "issue3": lambda: [ISSUE3, ISSUE3_MS],
    "issue5": lambda: [ISSUE5],
    "issue20": lambda: [ISSUE20, ISSUE20_BURST],
    "overnight": lambda: [OVERNIGHT],
    "issue3-failover": lambda: [ISSUE3_FAILOVER],
    "spendcap-failover": lambda: [SPENDCAP_FAILOVER, SPENDCAP_FAILOVER_STORM],
    "tpm": lambda: [TPM],
    "fleet": lambda: [FLEET],
    "fleet-cooldown": lambda: [FLEET_COOLDOWN],
    "outage": lambda: [OUTAGE],
    "tpm-full": lambda: [TPM_FULL],
    "agents": lambda: [AGENTS],
    "noisy-neighbour": lambda: [NOISY],
    "noisy-neighbour-slow": lambda: [NOISY_SLOW],
    "fair-share": lambda: [FAIR_SHARE],
    "fleet-cap": lambda: [FLEET_CAP],
    "replay": lambda: [replay("fixed", "ms"), replay("obey", "ms"), replay("fixed", "seconds"), replay("obey", "seconds")],
}
