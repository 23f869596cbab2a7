"""Storm scenarios: what the provider does (simulator scenarios, posted in phases), how many
clients call, how often, and through which gateway configurations."""

from __future__ import annotations

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
    "overnight": lambda: [OVERNIGHT],
    "replay": lambda: [replay("fixed", "ms"), replay("obey", "ms"), replay("fixed", "seconds"), replay("obey", "seconds")],
}
