"""The figures of a storm, read from what the simulator logged for the run's key (arrival time,
status, `decision`, `hint_ms`; `max_in_flight_by_key`) and from what the clients received.
Nothing of the simulator's window or the filter's cooldown is re-derived here.

Definitions (also in docs/benchmarks-history.md, "Storms with hold"):

- t = 0 is the instant the clients are released; an upstream request's time is the simulator's
  `unix_ms` (arrival) minus t = 0.
- **Cold first wave**: the initial burst as the provider saw it. Starting from the first upstream
  request, the requests that each arrive less than FIRST_WAVE_GAP_MS (100 ms) after the one
  before, at most one per client (the first `clients` requests). The log has arrival times only,
  and with no latency an answer is written the instant its request arrives, so "before the
  first answer came back" cannot be read from it; what can is that the burst is contiguous,
  while anything sent after an answer was known comes after a pause: a client's or gateway's
  wait (here 0.3 to 3 s) or the provider's latency. Requests in the burst were sent before the
  gateway could know anything and cannot be spared. A burst smeared by a busy machine stays
  one wave as long as it has no 100 ms hole; instant gateway retries (Envoy's, b) continue it,
  and the one-per-client bound ends it. Every other upstream request is "after the first wave".
- **Cooldown round**: a provider 429 that arrives at t, outside any round, with hint h (`hint_ms`,
  the retry hint the simulator logged as a client reads it) opens the round [t, t + h). A 429
  that arrives inside a round belongs to it and extends it to its own t + h if later (the
  latest "not before" the provider has given). A 429 without a hint is a round of its own.
  **max late 429s in a round** counts, per round, the 429s after the first wave: the issue's
  "at most one provider 429 per cooldown round after the first wave" is max <= 1.
- **client-visible 429s**: status 429 answers the clients received (the SDK's response hook, or
  the raw client), whoever sent them; **local** ones are those with `x-llm-governor-source`
  `cooldown` or `limit` (answered by the filter, not the provider).
- **p50 / p99**: time to completion of the completed calls. **p99 / schedule minimum**: p99
  divided by the earliest time the last call can complete (issue 3: 9,000 ms, the fourth
  window).

Failover storms (issue 9, two providers, each its own simulator and log):

- Every figure above that counts upstream requests or 429s counts both providers together
  (`upstream_requests`, `per_call`, `provider_429s`), and the same figure per provider is
  prefixed `primary_` or `backup_`.
- **Each pool's cold first wave**: the definition above applied to each provider's own log, so
  the second provider's first wave is the burst it received first (the steered retries of the
  primary's first wave, or LiteLLM's share of the first calls). `late_429s` is the sum of both
  providers' 429s after their own first waves; `max_late_429s_per_round` the largest over both
  providers' rounds.
- `primary_ok` / `backup_ok`: the 200s each provider logged, i.e. the calls each one served.

Token storms (issue 12; the provider's `tpm` bucket, clients calling in a loop):

- **calls**: the calls the clients made (each client calls again until the storm's duration);
  **completed** / **failed**: those that ended in a 2xx / in an exception the SDK raised (after
  its own retries) or the run's timeout.
- **provider token 429s**: upstream requests the simulator rejected for tokens (`decision`
  `tokens_exhausted` or `tokens_too_large`); **after 60 s**: those arriving at t >= 60 s, once
  the first minute's budget is spent and only the refill is left.
- **local 429s**: client-visible 429s the filter answered (`x-llm-governor-source` `limit` or
  `cooldown`); **held**: the filter's `held` counter over the storm (requests it held before
  deciding), and **held answers**: answers that carried `x-llm-governor-held-ms`.
- **overshoot of the local budget**: every upstream request is one the gateway let through, with
  the tokens the provider counted for it (`counted_tokens`, its input estimate + max_tokens,
  whether it then admitted it or not). Over the arrivals t, the most that the tokens let through
  up to t exceed the budget the local limit allows up to t, `tpm + tpm / 60 s x t` (full bucket
  at t = 0, then the refill), floored at 0; in tokens, and in requests (divided by the median
  `counted_tokens`). It measures the gateway against its own budget in the provider's counting:
  the difference between the gateway's input estimate and the provider's shows in it too.
"""

from __future__ import annotations

import statistics

import math
import random
from typing import NamedTuple, Optional

from .clients import strategy_c_delay_ms
from .scenarios import Storm

FIRST_WAVE_GAP_MS = 100.0


class Upstream(NamedTuple):
    """One request as the provider logged it."""

    t_ms: float
    status: int
    decision: str
    hint_ms: Optional[int]


def upstream(entries: list, t0_unix_ms: float) -> list:
    return [Upstream(q["unix_ms"] - t0_unix_ms, int(q["status"]), q.get("decision", ""), q.get("hint_ms"))
            for q in entries]


def first_wave(up: list, clients: int) -> int:
    """How many of the first upstream requests form the cold first wave (module doc)."""
    n = 0
    while n < min(clients, len(up)) and (n == 0 or up[n].t_ms - up[n - 1].t_ms < FIRST_WAVE_GAP_MS):
        n += 1
    return n


def cooldown_rounds(up: list, wave: int) -> list:
    """Rounds of provider 429s (module doc): [{start_ms, end_ms, first_wave_429s, late_429s}]."""
    rounds: list = []
    for i, u in enumerate(up):
        if u.status != 429:
            continue
        end = u.t_ms + (u.hint_ms or 0)
        if not rounds or u.t_ms >= rounds[-1]["end_ms"]:
            rounds.append({"start_ms": u.t_ms, "end_ms": end, "first_wave_429s": 0, "late_429s": 0})
        r = rounds[-1]
        r["end_ms"] = max(r["end_ms"], end)
        r["first_wave_429s" if i < wave else "late_429s"] += 1
    return rounds


def percentile(values: list, p: float) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))], 1)


def provider_figures(up: list, clients: int) -> dict:
    """One provider's figures: requests, 200s, 429s (by decision), its own cold first wave, 429s
    after it, and its cooldown rounds."""
    wave = first_wave(up, clients)
    rejected = [i for i, u in enumerate(up) if u.status == 429]
    rounds = cooldown_rounds(up, wave)
    return {
        "requests": len(up),
        "ok": sum(1 for u in up if u.status == 200),
        "429s": len(rejected),
        "429s_by_decision": _count(up[i].decision for i in rejected),
        "first_wave": wave,
        "first_wave_span_ms": round(up[wave - 1].t_ms - up[0].t_ms, 1) if wave else None,
        "first_wave_start_ms": round(up[0].t_ms, 1) if up else None,
        "first_wave_429s": sum(1 for i in rejected if i < wave),
        "late_429s": sum(1 for i in rejected if i >= wave),
        "max_late_429s_per_round": max((r["late_429s"] for r in rounds), default=0),
        "rounds": [{k: round(v, 1) for k, v in r.items()} for r in rounds],
    }


def measure(storm: Storm, config: str, config_name: str, results: list, entries: list, t0_unix_ms: float,
            phase_starts_ms: list, provider_max_in_flight: int, gateway_info: dict,
            backup_entries: Optional[list] = None, backup_foreign_keys: int = 0,
            backup_max_in_flight: int = 0) -> dict:
    """backup_entries: the second provider's log for the run (failover storms); then the
    combined and per-provider figures of the module doc are added."""
    up = upstream(entries, t0_unix_ms)
    wave = first_wave(up, storm.clients)
    rounds = cooldown_rounds(up, wave)
    rejected = [i for i, u in enumerate(up) if u.status == 429]
    attempts = [a for r in results for a in r.attempts]
    ok = [r for r in results if r.ok]
    durations = [r.end_ms - r.start_ms for r in ok]
    p99 = percentile(durations, 99)
    calls = storm.calls or max(1, len(results))  # a loop storm makes as many calls as fit
    out: dict = {
        "scenario": storm.name,
        "title": storm.title,
        "config": config,
        "config_name": config_name,
        "clients": storm.clients,
        "calls": calls,
        "completed": len(ok),
        "completion_rate": round(len(ok) / calls, 3),
        "upstream_requests": len(up),
        "per_call": round(len(up) / calls, 2),
        "provider_429s": len(rejected),
        "provider_429s_by_decision": _count(up[i].decision for i in rejected),
        "first_wave": wave,
        "first_wave_span_ms": round(up[wave - 1].t_ms - up[0].t_ms, 1) if wave else None,
        "first_wave_429s": sum(1 for i in rejected if i < wave),
        "late_429s": sum(1 for i in rejected if i >= wave),
        "rounds": [{k: round(v, 1) for k, v in r.items()} for r in rounds],
        "max_late_429s_per_round": max((r["late_429s"] for r in rounds), default=0),
        "client_429s": sum(1 for a in attempts if a.status == 429),
        "client_local_429s": sum(1 for a in attempts if a.status == 429 and a.source in ("cooldown", "limit")),
        "client_attempts": len(attempts),
        "held_answers": sum(1 for a in attempts if a.held_ms is not None),
        "max_held_ms": max((a.held_ms for a in attempts if a.held_ms is not None), default=None),
        "provider_max_in_flight": provider_max_in_flight,
        "p50_ms": percentile(durations, 50),
        "p99_ms": p99,
        "errors": _count(r.error for r in results if not r.ok),
        "upstream": [[round(u.t_ms, 1), u.status] for u in up],
        "client_ends": [[round(r.end_ms, 1), r.ok] for r in results],
        "gateway": gateway_info,
        # What each call received, to read a run back: [t_ms, status, source, pool, held_ms,
        # retry_after_ms] per answer, a list per call.
        "call_attempts": [[[round(a.t_ms, 1), a.status, a.source, a.pool, a.held_ms,
                            None if a.retry_after_ms is None else round(a.retry_after_ms)] for a in r.attempts]
                          for r in results],
    }
    if backup_entries is not None:
        bup = upstream(backup_entries, t0_unix_ms)
        primary, backup = provider_figures(up, storm.clients), provider_figures(bup, storm.clients)
        for name, figures in (("primary", primary), ("backup", backup)):
            out.update({f"{name}_{k}": v for k, v in figures.items()})
        out.update({
            "upstream_requests": len(up) + len(bup),
            "per_call": round((len(up) + len(bup)) / storm.calls, 2),
            "provider_429s": primary["429s"] + backup["429s"],
            "first_wave": primary["first_wave"] + backup["first_wave"],
            "first_wave_429s": primary["first_wave_429s"] + backup["first_wave_429s"],
            "late_429s": primary["late_429s"] + backup["late_429s"],
            "max_late_429s_per_round": max(primary["max_late_429s_per_round"], backup["max_late_429s_per_round"]),
            "backup_foreign_keys": backup_foreign_keys,
            "backup_max_in_flight": backup_max_in_flight,
            "backup_upstream": [[round(u.t_ms, 1), u.status] for u in bup],
            # Both providers' requests in time order, for the timeline plot.
            "upstream": sorted(out["upstream"] + [[round(u.t_ms, 1), u.status] for u in bup]),
            "steered_answers": sum(1 for a in attempts if a.pool),
            # What each provider logged, to read a run back: [t_ms, status, decision, hint_ms,
            # window_count, in_flight_key] per request (t_ms from t = 0).
            "primary_log": _log(entries, t0_unix_ms),
            "backup_log": _log(backup_entries, t0_unix_ms),
        })
    if storm.tenants:
        out.update(tenant_figures(storm, results, up))
        out["provider_log"] = _log(entries, t0_unix_ms)
    if storm.tpm_tokens:
        out.update(token_figures(storm.tpm_tokens, entries, t0_unix_ms, results, gateway_info))
    if storm.cap:
        out.update(cap_figures(storm, up))
    if storm.itpm_tokens:
        out.update(agent_figures(storm, entries, t0_unix_ms, gateway_info))
    if storm.schedule_min_ms:
        out["schedule_min_ms"] = storm.schedule_min_ms
        out["p99_over_schedule_min"] = None if p99 is None else round(p99 / storm.schedule_min_ms, 3)
    if storm.recovers_in_phase is not None and storm.recovers_in_phase < len(phase_starts_ms):
        rec = phase_starts_ms[storm.recovers_in_phase] + storm.recovers_after_ms
        after = [u.t_ms for u in up if u.decision == "ok" and u.t_ms >= rec]
        out["recovers_at_ms"] = round(rec, 1)
        out["first_success_after_recovery_ms"] = round(min(after) - rec, 1) if after else None
        throttled = [i for i, u in enumerate(up) if u.t_ms < rec]
        out["throttled_window_requests"] = len(throttled)
        out["peak_100ms_in_throttled_window"] = _peak([up[i].t_ms for i in throttled])
        out["late_requests_in_throttled_window"] = sum(1 for i in throttled if i >= wave)
    return out


def tenant_figures(storm: Storm, results: list, up: list) -> dict:
    """The noisy-neighbour storm's figures (issue 33). Per tenant: calls made, completed, failed,
    the wait of its completed calls (start of the call to its answer, the SDK's own retries
    included) at p50 / p95, and the local 429s its clients received (x-llm-governor-source
    `cooldown` or `limit`). The provider's admissions per second: its 200s from t = 2 s (one
    window after the first wave) to the end of the calls (`duration_s`), per second; `pace_used`
    is that over the limit's rate (requests / window). Provider 429s after the first second: the
    upstream 429s at t >= 1 s."""
    limit = storm.phases[0].scenario.get("limit") or {}
    rate = limit["requests"] * 1000 / limit["window_ms"] if limit else None
    start, end = 2000.0, storm.duration_s * 1000
    admitted = sum(1 for u in up if u.status == 200 and start <= u.t_ms < end)
    per_s = admitted * 1000 / (end - start)
    tenants = {}
    for t in storm.tenants:
        mine = [r for r in results if r.tenant == t.name]
        waits = [r.end_ms - r.start_ms for r in mine if r.ok]
        attempts = [a for r in mine for a in r.attempts]
        tenants[t.name] = {
            "calls": len(mine),
            "completed": len(waits),
            "failed": len(mine) - len(waits),
            "p50_wait_ms": percentile(waits, 50),
            "p95_wait_ms": percentile(waits, 95),
            "max_wait_ms": percentile(waits, 100),
            "local_429s": sum(1 for a in attempts if a.status == 429 and a.source in ("cooldown", "limit")),
            "provider_429s_seen": sum(1 for a in attempts if a.status == 429 and a.source in ("", "upstream")),
            "errors": _count(r.error for r in mine if not r.ok),
        }
    return {
        "tenants": tenants,
        "admitted_per_s": round(per_s, 2),
        "pace_used": round(per_s / rate, 3) if rate else None,
        "provider_429s_after_1s": sum(1 for u in up if u.status == 429 and u.t_ms >= 1000),
    }


def cap_figures(storm: Storm, up: list) -> dict:
    """The fleet-cap storm's figures (issue 31). What the cap lets through: `cap` answers every
    latency. Served per second: the provider's 200s over the busy span, from its first request
    to the last 200's answer (its arrival plus the latency); `of_cap` is that over what the cap
    lets through. Concurrency 429s: the provider's 429s for a request past its concurrency."""
    latency = storm.phases[0].scenario["latency_ms"]
    ok = [u.t_ms for u in up if u.status == 200]
    span = max(ok) + latency - up[0].t_ms if ok else None
    per_s = len(ok) * 1000 / span if span else 0.0
    return {
        "served_per_s": round(per_s, 2),
        "of_cap": round(per_s / (storm.cap * 1000 / latency), 3),
        "concurrency_429s": sum(1 for u in up if u.status == 429 and u.decision == "concurrency"),
    }


TOKEN_DECISIONS = ("tokens_exhausted", "tokens_too_large")


def agent_figures(storm: Storm, entries: list, t0_unix_ms: float, gateway_info: dict) -> dict:
    """The agents storm's figures (issue 32), from the simulator's log of the run's key.

    - **served in the run**: the provider's 200s that arrived before `duration_s` (calls still
      held or on their way at the end are not in it).
    - **the provider admits on its own**: what its two buckets can count over the run (capacity
      plus refill over `duration_s`), in calls of the run's mean count per served call (input:
      uncached input + cache writes; output: tokens generated); the fewer of the two.
    - **provider 429s**: by the dimension the simulator refused (`input_tokens_exhausted`,
      `output_tokens_exhausted`).
    - **input prediction median error**: the gateway's `input_prediction_error_pct` histogram's
      cumulative median (|reserved input - counted input| / counted, in %).
    """
    d_ms = storm.duration_s * 1000
    served = [q for q in entries if int(q["status"]) == 200]
    in_run = [q for q in served if q["unix_ms"] - t0_unix_ms < d_ms]
    inputs = [q.get("input_tokens", 0) + q.get("cache_creation_tokens", 0) for q in served]
    outputs = [q.get("output_tokens", 0) for q in served]
    budget = lambda per_minute: per_minute * (1 + storm.duration_s / 60)  # noqa: E731
    by_input = budget(storm.itpm_tokens) / statistics.mean(inputs) if inputs else None
    by_output = budget(storm.otpm_tokens) / statistics.mean(outputs) if outputs else None
    bounds = [b for b in (by_input, by_output) if b]
    admits = min(bounds) if bounds else None
    return {
        "served_in_run": len(in_run),
        "admits_by_input": None if by_input is None else round(by_input, 1),
        "admits_by_output": None if by_output is None else round(by_output, 1),
        "provider_admits": None if admits is None else round(admits, 1),
        "of_provider_admits": None if not admits else round(len(in_run) / admits, 3),
        "input_429s": sum(1 for q in entries if q.get("decision") == "input_tokens_exhausted"),
        "output_429s": sum(1 for q in entries if q.get("decision") == "output_tokens_exhausted"),
        "mean_input_counted": round(statistics.mean(inputs), 1) if inputs else None,
        "mean_output_counted": round(statistics.mean(outputs), 1) if outputs else None,
        "cache_reads": sum(q.get("cache_read_tokens", 0) for q in served),
        "input_error_p50_pct": gateway_info.get("input_prediction_error_pct_p50"),
        "output_error_p50_pct": gateway_info.get("output_prediction_error_pct_p50"),
        "held": gateway_info.get("held", 0),
    }


def overshoot(sent: list, tpm: int) -> tuple:
    """(tokens, at_ms): the most that sum(counted) up to each arrival exceeds tpm + tpm/60 s x t,
    floored at 0, and when. `sent`: (t_ms, counted_tokens) in arrival order."""
    total, worst, at = 0, 0.0, None
    for t_ms, counted in sent:
        total += counted
        over = total - (tpm + tpm * max(0.0, t_ms) / 60_000)
        if over > worst:
            worst, at = over, t_ms
    return round(worst), at


def token_figures(tpm: int, entries: list, t0_unix_ms: float, results: list, gateway_info: dict) -> dict:
    """The token storm's figures (module doc), from the simulator's log of the run's key."""
    sent = [(q["unix_ms"] - t0_unix_ms, int(q.get("counted_tokens") or 0)) for q in entries]
    counted = sorted(c for _, c in sent if c)
    typical = counted[len(counted) // 2] if counted else 0
    tokens, at = overshoot(sent, tpm)
    rejected = [t for (t, _), q in zip(sent, entries) if q.get("decision") in TOKEN_DECISIONS]
    attempts = [a for r in results for a in r.attempts]
    failed = [r for r in results if not r.ok]
    admitted = [c for (_, c), q in zip(sent, entries) if q.get("decision") == "ok"]
    return {
        "tpm_tokens": tpm,
        "failed_calls": len(failed),
        "token_429s": len(rejected),
        "token_429s_after_60s": sum(1 for t in rejected if t >= 60_000),
        "provider_ok": len(admitted),
        "provider_ok_tokens": sum(admitted),
        "counted_tokens_median": typical,
        "overshoot_tokens": tokens,
        "overshoot_requests": round(tokens / typical, 1) if typical else 0.0,
        "overshoot_at_ms": None if at is None else round(at, 1),
        "held": gateway_info.get("held"),
        "hold_expired": gateway_info.get("hold_expired"),
        "local_reject_limit": gateway_info.get("local_reject_limit"),
        "client_other_errors": sum(1 for a in attempts if a.status >= 400 and a.status != 429),
        # [t_ms, status, decision, counted_tokens, tokens_remaining] per upstream request.
        "token_log": [[round(t, 1), q["status"], q.get("decision"), c, q.get("tokens_remaining")]
                      for (t, c), q in zip(sent, entries)],
        # Per call: [start_ms, end_ms, error, [[t_ms, status, source, held_ms, retry_after_ms], ...]].
        "call_attempts": [[round(r.start_ms, 1), round(r.end_ms, 1), r.error,
                           [[round(a.t_ms, 1), a.status, a.source, a.held_ms,
                             None if a.retry_after_ms is None else round(a.retry_after_ms)] for a in r.attempts]]
                          for r in results],
    }


def _log(entries: list, t0_unix_ms: float) -> list:
    return [[round(q["unix_ms"] - t0_unix_ms, 1), q["status"], q.get("decision"), q.get("hint_ms"),
             q.get("window_count"), q.get("in_flight_key")] for q in entries]


def _peak(times: list) -> int:
    buckets: dict = {}
    for t in times:
        buckets[int(t // 100)] = buckets.get(int(t // 100), 0) + 1
    return max(buckets.values(), default=0)


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def published_replay(strategy: str, clients: int = 120, recover_ms: int = 2000, attempts: int = 4,
                     budget_ms: int = 2500, seed: int = 107) -> dict:
    """The published replay's own model, offline: only attempts at t >= recover_ms succeed."""
    rng = random.Random(seed)
    sent, completed, times = 0, 0, []
    for _ in range(clients):
        at = 0.0
        for attempt in range(1, attempts + 1):
            sent += 1
            times.append(at)
            if at >= recover_ms:
                completed += 1
                break
            if strategy == "immediate":
                delay = 0
            elif strategy == "exponential":
                delay = 250 * 2 ** (attempt - 1)
            else:
                delay = strategy_c_delay_ms(attempt, rng.randrange(0, 251))
            if attempt == attempts or at + delay > budget_ms:
                break
            at += delay
    throttled = [t for t in times if t < recover_ms]
    return {"strategy": strategy, "requests": sent, "completed": completed,
            "completion_rate": round(completed / clients, 3), "peak_100ms_in_throttled_window": _peak(throttled),
            "final_attempt_ms": max(times)}
