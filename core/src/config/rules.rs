//! The rules that relate fields: the configuration as written (`wire`) becomes a validated
//! `Config`, or an error naming the field the way `tree` does (`limits[0].burst: ...`).

use super::defaults;
use super::matcher::named;
use super::model::{
    err, Config, ConfigError, Counts, Fleet, Limit, LimitKind, Pool, Scope, DAY_S, MINUTE_S,
};
use super::values::{
    int_in, positive, Bounded, ClusterName, Flag, KeySpec, OutputSpec, ScopeSpec, SettleSpec,
    StatName, UncheckedInt,
};
use super::wire::{ConfigDto, LimitDto, PoolDto, MAX_DURATION_MS, MAX_IN_FLIGHT, MAX_PER_WINDOW};

impl TryFrom<ConfigDto> for Config {
    type Error = ConfigError;

    fn try_from(dto: ConfigDto) -> Result<Config, ConfigError> {
        let mut cfg = Config::default();
        if let Some(Bounded(items)) = dto.pools {
            let mut pools = Vec::with_capacity(items.len() + 1);
            let mut fallbacks = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                let at = format!("pools[{i}]");
                let (pool, fallback) = pool_from(item, &at)?;
                if pools.iter().any(|p: &Pool| p.name == pool.name) {
                    return Err(err(
                        &format!("{at}.name"),
                        format!("duplicate pool name {:?}", pool.name),
                    ));
                }
                pools.push(pool);
                fallbacks.push(fallback);
            }
            resolve_fallbacks(&mut pools, &fallbacks)?;
            pools.push(defaults::unmatched_pool());
            cfg.pools = pools;
        }
        if let Some(Bounded(headers)) = dto.account_headers {
            cfg.account_headers = headers.into_iter().map(|h| h.0).collect();
        }
        if let Some(r) = dto.retry_after {
            let c = &mut cfg.retry_after;
            set(&mut c.default_ms, r.default_ms.map(|v| v.0));
            set(&mut c.max_ms, r.max_ms.map(|v| v.0));
            set(&mut c.jitter, r.jitter.map(|v| v.0));
            set(&mut c.escalate, r.escalate.map(|v| v.0));
            if c.default_ms > c.max_ms {
                return Err(err(
                    "retry_after.default_ms",
                    format!("must be <= retry_after.max_ms ({})", c.max_ms),
                ));
            }
        }
        if let Some(d) = dto.cooldown {
            let c = &mut cfg.cooldown;
            set(&mut c.enabled, d.enabled.map(|v| v.0));
            set(&mut c.max_ms, d.max_ms.map(|v| v.0));
            set(&mut c.quota_ms, d.quota_ms.map(|v| v.0));
        }
        set(&mut cfg.preemptive, dto.preemptive.map(|v| v.0));
        if let Some(Bounded(items)) = dto.limits {
            for (i, item) in items.into_iter().enumerate() {
                let at = format!("limits[{i}]");
                let limit = limit_from(item, &at)?;
                if cfg.limits.iter().any(|l| l.name == limit.name) {
                    return Err(err(
                        &format!("{at}.name"),
                        format!("duplicate limit name {:?}", limit.name),
                    ));
                }
                cfg.limits.push(limit);
            }
        }
        set(&mut cfg.max_keys, dto.max_keys.map(|v| v.0));
        if let Some(h) = dto.hold {
            super::hold::hold_from(h, &mut cfg.hold)?;
        }
        if let Some(f) = dto.fleet {
            let Some(ClusterName(cluster)) = f.cluster else {
                return Err(err("fleet.cluster", "is required".into()));
            };
            let reservations = f.reservations.map_or(defaults::RESERVATIONS, |v| v.0);
            // Opt-in while it is proven only against the fake service (issue 31).
            let cooldowns = f.cooldowns.is_some_and(|v| v.0);
            if cooldowns && !reservations {
                return Err(err(
                    "fleet.cooldowns",
                    "shared cooldowns hold a turn on the service (Reserve / Commit): set \"reservations\": true, or \"cooldowns\": false".into(),
                ));
            }
            cfg.fleet = Some(Fleet {
                cluster,
                domain: f
                    .domain
                    .map_or_else(|| defaults::DEFAULT_FLEET_DOMAIN.to_string(), |d| d.0),
                timeout_ms: f
                    .timeout_ms
                    .map_or(defaults::DEFAULT_FLEET_TIMEOUT_MS, |v| v.0),
                on_error: f.on_error.map_or(defaults::ON_ERROR, |v| v.0),
                reservations,
                cooldowns,
            });
        }
        if let Some(i) = cfg.limits.iter().position(|l| l.scope == Scope::Fleet) {
            match &cfg.fleet {
                None => {
                    return Err(err(
                        &format!("limits[{i}].scope"),
                        "\"fleet\" needs a \"fleet\" section (the rate-limit service's cluster)"
                            .into(),
                    ))
                }
                Some(f) if !f.reservations => {
                    let cap = |l: &Limit| l.scope == Scope::Fleet && l.kind == LimitKind::InFlight;
                    if let Some(i) = cfg.limits.iter().position(cap) {
                        return Err(err(
                            &format!("limits[{i}].scope"),
                            "a fleet max_in_flight holds its slots on the service (Reserve / Commit): set fleet.reservations true".into(),
                        ));
                    }
                }
                Some(_) => {}
            }
        }
        Ok(cfg)
    }
}

/// A given field replaces the default.
fn set<T>(slot: &mut T, given: Option<T>) {
    if let Some(v) = given {
        *slot = v;
    }
}

/// A pool, and the names its `fallback` lists (resolved once every pool is known).
fn pool_from(dto: PoolDto, at: &str) -> Result<(Pool, Vec<String>), ConfigError> {
    let implicit = (defaults::DEFAULT_POOL, "requests that match no pool");
    let (name, matcher) = named(dto.name, dto.r#match, at, implicit)?;
    let pool = Pool {
        name,
        matcher,
        dialect: dto.dialect.map_or(defaults::DIALECT, |d| d.0),
        fallback: Vec::new(),
        account: dto.account.map(|a| a.0),
    };
    let fallback = dto.fallback.map_or_else(Vec::new, |Bounded(names)| {
        names.into_iter().map(|n| n.0).collect()
    });
    Ok((pool, fallback))
}

/// Turn fallback names into pool indices: unknown names, a pool listing itself or another
/// twice, and cycles (a pool reachable from itself through fallbacks) are refused.
fn resolve_fallbacks(pools: &mut [Pool], names: &[Vec<String>]) -> Result<(), ConfigError> {
    for (i, list) in names.iter().enumerate() {
        let mut resolved = Vec::with_capacity(list.len());
        for (j, name) in list.iter().enumerate() {
            let at = format!("pools[{i}].fallback[{j}]");
            let Some(k) = pools.iter().position(|p| &p.name == name) else {
                return Err(err(&at, format!("unknown pool {name:?}")));
            };
            if k == i {
                return Err(err(&at, "a pool cannot be its own fallback".into()));
            }
            if resolved.contains(&k) {
                return Err(err(&at, format!("{name:?} is listed twice")));
            }
            resolved.push(k);
        }
        pools[i].fallback = resolved;
    }
    for start in 0..pools.len() {
        // Depth-first walk from `start`; reaching `start` again is a cycle.
        let mut stack: Vec<usize> = pools[start].fallback.clone();
        let mut seen = vec![false; pools.len()];
        while let Some(k) = stack.pop() {
            if k == start {
                return Err(err(
                    &format!("pools[{start}].fallback"),
                    format!(
                        "cycle: {:?} falls back to itself through other pools",
                        pools[start].name
                    ),
                ));
            }
            if !std::mem::replace(&mut seen[k], true) {
                stack.extend(pools[k].fallback.iter().copied());
            }
        }
    }
    Ok(())
}

fn limit_from(mut dto: LimitDto, at: &str) -> Result<Limit, ConfigError> {
    let Some(StatName(name)) = dto.name.take() else {
        return Err(err(&format!("{at}.name"), "is required".into()));
    };
    let Some(KeySpec(key)) = dto.key.take() else {
        return Err(err(&format!("{at}.key"), "is required".into()));
    };
    let Rate {
        kind,
        counts,
        window_s,
        amount: per_window,
    } = counted(&dto, at)?;
    let mut limit = LimitFields {
        at,
        kind,
        counts,
        reserve: defaults::RESERVE,
    };
    let burst = limit
        .only("burst", dto.burst, &[RATE_LIMIT], |v| {
            positive(v, MAX_PER_WINDOW)
        })?
        .unwrap_or(defaults::burst(per_window));
    let slot_lease_ms = limit
        .only(
            "slot_lease_ms",
            dto.slot_lease_ms,
            &[IN_FLIGHT_LIMIT],
            |v| int_in(v, 1000, MAX_DURATION_MS),
        )?
        .unwrap_or(defaults::SLOT_LEASE_MS);
    limit.reserve = limit
        .only("reserve", dto.reserve, &[TOKEN_LIMIT], |Flag(b)| Ok(b))?
        .unwrap_or(defaults::RESERVE);
    let default_output_tokens = limit
        .only(
            "default_output_tokens",
            dto.default_output_tokens,
            &[TOKEN_LIMIT, RESERVING],
            |v| int_in(v, 0, crate::estimate::MAX_OUTPUT),
        )?
        .unwrap_or(defaults::DEFAULT_OUTPUT_TOKENS);
    let settle = limit
        .only(
            "settle",
            dto.settle,
            &[TOKEN_LIMIT, RESERVING],
            |SettleSpec(s)| Ok(s),
        )?
        .unwrap_or(defaults::SETTLE);
    let count_cache_reads = limit
        .only(
            "count_cache_reads",
            dto.count_cache_reads,
            &[TOKEN_LIMIT, COUNTS_INPUT],
            |Flag(b)| Ok(b),
        )?
        .unwrap_or(defaults::COUNT_CACHE_READS);
    let output = limit
        .only(
            "output",
            dto.output,
            &[TOKEN_LIMIT, COUNTS_OUTPUT, RESERVING],
            |OutputSpec(o)| Ok(o),
        )?
        .unwrap_or(defaults::OUTPUT);
    let min_output_tokens = limit
        .only(
            "min_output_tokens",
            dto.min_output_tokens,
            &[TOKEN_LIMIT, COUNTS_OUTPUT, RESERVING],
            |v| int_in(v, 0, crate::estimate::MAX_OUTPUT),
        )?
        .unwrap_or(defaults::MIN_OUTPUT_TOKENS);
    let scope = limit
        .only("scope", dto.scope, &[], |ScopeSpec(s)| Ok(s))?
        .unwrap_or(defaults::SCOPE);
    Ok(Limit {
        name,
        key,
        kind,
        counts,
        per_window,
        window_s,
        burst,
        slot_lease_ms,
        reserve: limit.reserve,
        default_output_tokens,
        settle,
        count_cache_reads,
        output,
        min_output_tokens,
        scope,
    })
}

/// What a rate field says: the kind of limit, what it counts, over which window, how many.
struct Rate {
    kind: LimitKind,
    counts: Counts,
    window_s: u64,
    amount: u64,
}

/// What a limit counts and how many, from the one field given of those that say it: one row
/// per such field (a new rate is a row here, and its kind's answers in the `Need`s below).
fn counted(dto: &LimitDto, at: &str) -> Result<Rate, ConfigError> {
    use Counts::{InputTokens, OutputTokens, Tokens as AllTokens};
    use LimitKind::{InFlight, Requests, Tokens};
    type Row = (
        &'static str,
        Option<UncheckedInt>,
        LimitKind,
        Counts,
        u64,
        u64,
    );
    let rows: [Row; 7] = [
        (
            "requests_per_minute",
            dto.requests_per_minute,
            Requests,
            AllTokens,
            MINUTE_S,
            MAX_PER_WINDOW,
        ),
        (
            "requests_per_day",
            dto.requests_per_day,
            Requests,
            AllTokens,
            DAY_S,
            MAX_PER_WINDOW,
        ),
        (
            "tokens_per_minute",
            dto.tokens_per_minute,
            Tokens,
            AllTokens,
            MINUTE_S,
            MAX_PER_WINDOW,
        ),
        (
            "tokens_per_day",
            dto.tokens_per_day,
            Tokens,
            AllTokens,
            DAY_S,
            MAX_PER_WINDOW,
        ),
        (
            "input_tokens_per_minute",
            dto.input_tokens_per_minute,
            Tokens,
            InputTokens,
            MINUTE_S,
            MAX_PER_WINDOW,
        ),
        (
            "output_tokens_per_minute",
            dto.output_tokens_per_minute,
            Tokens,
            OutputTokens,
            MINUTE_S,
            MAX_PER_WINDOW,
        ),
        (
            "max_in_flight",
            dto.max_in_flight,
            InFlight,
            AllTokens,
            0,
            MAX_IN_FLIGHT,
        ),
    ];
    let mut given = rows
        .iter()
        .filter_map(|&(field, value, kind, counts, w, max)| {
            Some((field, value?, kind, counts, w, max))
        });
    let fields = || {
        let [rest @ .., last] = rows.map(|row| row.0);
        format!("{} or {last}", rest.join(", "))
    };
    match (given.next(), given.next()) {
        (Some((field, value, kind, counts, window_s, max)), None) => positive(value, max)
            .map(|amount| Rate {
                kind,
                counts,
                window_s,
                amount,
            })
            .map_err(|reason| err(&format!("{at}.{field}"), reason)),
        (Some(_), Some(_)) => Err(err(at, format!("set one of {}, not several", fields()))),
        (None, _) => Err(err(at, format!("one of {} is required", fields()))),
    }
}

/// A limit being read, as the fields that only some limits take see it.
struct LimitFields<'a> {
    at: &'a str,
    kind: LimitKind,
    counts: Counts,
    /// The default until `reserve` itself is read (the fields before it do not ask).
    reserve: bool,
}

/// What a field needs of its limit, and the reason it is refused where the limit lacks it.
struct Need {
    holds: fn(&LimitFields) -> bool,
    otherwise: &'static str,
}

// One row per condition; a field lists the ones it needs, checked in that order.
const RATE_LIMIT: Need = Need {
    holds: |l| l.kind != LimitKind::InFlight,
    otherwise: "applies to the rates (requests_per_*, *tokens_per_*), not max_in_flight",
};
const IN_FLIGHT_LIMIT: Need = Need {
    holds: |l| l.kind == LimitKind::InFlight,
    otherwise: "applies to max_in_flight limits only",
};
const TOKEN_LIMIT: Need = Need {
    holds: |l| l.kind == LimitKind::Tokens,
    otherwise: "applies to token limits only (tokens_per_minute, tokens_per_day, \
                input_tokens_per_minute, output_tokens_per_minute)",
};
const COUNTS_INPUT: Need = Need {
    holds: |l| l.counts.input(),
    otherwise: "applies to limits that count input tokens, not output_tokens_per_minute",
};
const COUNTS_OUTPUT: Need = Need {
    holds: |l| l.counts.output(),
    otherwise: "applies to limits that count output tokens, not input_tokens_per_minute",
};
const RESERVING: Need = Need {
    holds: |l| l.reserve,
    otherwise: "applies only when reserve is true",
};

impl LimitFields<'_> {
    /// A field that only some limits take: None where it is left out; else refused with the
    /// first of `needs` this limit does not meet, or read by `check`. Errors name the field.
    fn only<T, U>(
        &self,
        field: &str,
        given: Option<T>,
        needs: &[Need],
        check: impl FnOnce(T) -> Result<U, String>,
    ) -> Result<Option<U>, ConfigError> {
        let Some(value) = given else {
            return Ok(None);
        };
        let at = format!("{}.{field}", self.at);
        if let Some(unmet) = needs.iter().find(|need| !(need.holds)(self)) {
            return Err(err(&at, unmet.otherwise.into()));
        }
        check(value).map(Some).map_err(|reason| err(&at, reason))
    }
}
