"""One storm through one gateway: reset the simulator, post the first scenario and release the
clients together, post later phases on time, then read the simulator's log for the run's key.
A failover storm does the same with the second simulator (`backup`) and its own phases."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Optional

from harness import Simulator

from . import analysis
from .clients import Clock, run_clients
from .gateways import Gateway
from .scenarios import Storm, resolve

# Calls that ended without an answer may leave gateway requests (retries, releases) still on
# their way: then the log is read once it has stopped growing.
_UNANSWERED = ("run timeout", "APITimeoutError", "APIConnectionError", "budget expired")


def run_storm(storm: Storm, gateway: Gateway, sim: Simulator, backup: Optional[Simulator] = None) -> dict:
    """backup: the second provider, required when the storm has `backup_phases`."""
    if storm.backup_phases is not None and backup is None:
        raise ValueError(f"storm {storm.name} needs a second simulator")
    backup = backup if storm.backup_phases is not None else None
    sim.reset()
    if backup is not None:
        backup.reset()
    client_key = gateway.client_key(f"sk-storm-{storm.name}-{uuid.uuid4().hex[:8]}")
    upstream_key = gateway.upstream_key(client_key)
    counters_before = gateway.info()
    clock = Clock()
    phase_unix_ms: list = []  # when each (primary) phase's scenario was in force
    # Later phases of both providers, in the order they are due: (at_ms, simulator, scenario).
    later = sorted([(ph.at_ms, 0, ph.scenario) for ph in storm.phases[1:]]
                   + [(ph.at_ms, 1, ph.scenario) for ph in (storm.backup_phases or [])[1:]], key=lambda x: x[:2])

    def post(which: int, scenario: dict) -> None:
        (backup if which else sim).scenario(resolve(scenario, upstream_key))
        if not which:
            phase_unix_ms.append(time.time() * 1000)

    def release() -> None:
        if backup is not None:
            post(1, storm.backup_phases[0].scenario)
        post(0, storm.phases[0].scenario)

    async def main() -> list:
        urls = gateway.client_urls(storm.clients)
        clients = asyncio.create_task(run_clients(storm, urls, client_key, clock, release, gateway.extra_body))
        if later:
            started = asyncio.create_task(clock.started.wait())
            await asyncio.wait([clients, started], return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            for at_ms, which, scenario in later:
                if clients.done():
                    break
                await asyncio.sleep(max(0.0, at_ms - clock.now_ms()) / 1000)
                await asyncio.to_thread(post, which, scenario)
        return await clients

    results = asyncio.run(main())
    unanswered = any(r.error.startswith(_UNANSWERED) for r in results)
    log = settled_log(sim) if unanswered else sim.requests()
    # The log is in arrival order (the simulator decides under one lock).
    entries = [q for q in log.get("requests", []) if q.get("key") == upstream_key]
    backup_figures: dict = {}
    if backup is not None:
        blog = settled_log(backup) if unanswered else backup.requests()
        bkey = gateway.backup_key()
        every = blog.get("requests", [])
        backup_figures = {
            # A configuration without a fallback sends the second provider nothing: whatever it
            # logged (nothing, expectedly) counts.
            "backup_entries": [q for q in every if bkey is None or q.get("key") == bkey],
            # Requests the second provider saw under any other key (a client's own credential
            # leaking past the fallback route would show here).
            "backup_foreign_keys": sum(1 for q in every if bkey is not None and q.get("key") != bkey),
            "backup_max_in_flight": max(blog.get("max_in_flight_by_key", {}).values(), default=0)
            if bkey is None else blog.get("max_in_flight_by_key", {}).get(bkey, 0),
        }
    return analysis.measure(
        storm, gateway.key, gateway.name, results, entries,
        t0_unix_ms=clock.t0_unix_ms,
        phase_starts_ms=[t - clock.t0_unix_ms for t in phase_unix_ms],
        provider_max_in_flight=log.get("max_in_flight_by_key", {}).get(upstream_key, 0),
        gateway_info=_added(counters_before, gateway.info()),
        **backup_figures,
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
