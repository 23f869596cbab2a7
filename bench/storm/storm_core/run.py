"""One storm through one gateway: reset the simulator, post the first scenario and release the
clients together, post later phases on time, then read the simulator's log for the run's key."""

from __future__ import annotations

import asyncio
import time
import uuid

from harness import Simulator

from . import analysis
from .clients import Clock, run_clients
from .gateways import Gateway
from .scenarios import Storm

# Calls that ended without an answer may leave gateway requests (retries, releases) still on
# their way: then the log is read once it has stopped growing.
_UNANSWERED = ("run timeout", "APITimeoutError", "APIConnectionError", "budget expired")


def run_storm(storm: Storm, gateway: Gateway, sim: Simulator) -> dict:
    sim.reset()
    client_key = gateway.client_key(f"sk-storm-{storm.name}-{uuid.uuid4().hex[:8]}")
    upstream_key = gateway.upstream_key(client_key)
    counters_before = gateway.info()
    clock = Clock()
    phase_unix_ms: list = []  # when each phase's scenario was in force

    def post(scenario: dict) -> None:
        sim.scenario(scenario)
        phase_unix_ms.append(time.time() * 1000)

    async def main() -> list:
        clients = asyncio.create_task(run_clients(
            storm, gateway.base_url(), client_key, clock, lambda: post(storm.phases[0].scenario)))
        if len(storm.phases) > 1:
            started = asyncio.create_task(clock.started.wait())
            await asyncio.wait([clients, started], return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            for phase in storm.phases[1:]:
                if clients.done():
                    break
                await asyncio.sleep(max(0.0, phase.at_ms - clock.now_ms()) / 1000)
                await asyncio.to_thread(post, phase.scenario)
        return await clients

    results = asyncio.run(main())
    unanswered = any(r.error.startswith(_UNANSWERED) for r in results)
    log = settled_log(sim) if unanswered else sim.requests()
    # The log is in arrival order (the simulator decides under one lock).
    entries = [q for q in log.get("requests", []) if q.get("key") == upstream_key]
    return analysis.measure(
        storm, gateway.key, gateway.name, results, entries,
        t0_unix_ms=clock.t0_unix_ms,
        phase_starts_ms=[t - clock.t0_unix_ms for t in phase_unix_ms],
        provider_max_in_flight=log.get("max_in_flight_by_key", {}).get(upstream_key, 0),
        gateway_info=_added(counters_before, gateway.info()),
    )


def settled_log(sim: Simulator, quiet_s: float = 1.0, limit_s: float = 15.0) -> dict:
    """The simulator's log once nothing is in flight and no entry was added for quiet_s."""
    deadline = time.monotonic() + limit_s
    log = sim.requests()
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = sim.requests()
        if now["total"] != log["total"] or now["in_flight"]:
            quiet_since = time.monotonic()
        log = now
        if time.monotonic() - quiet_since >= quiet_s:
            break
    return log


def _added(before: dict, after: dict) -> dict:
    """What one storm added to the gateway's counters (other values as they are after it)."""
    return {k: v - before.get(k, 0) if isinstance(v, int) else v for k, v in after.items()}
