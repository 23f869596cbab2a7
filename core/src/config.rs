//! The plugin configuration: JSON in, a validated `Config` out, or an error naming the field.
//!
//! Three steps, each with one job:
//! - serde DTOs (`deny_unknown_fields`) say which fields exist; their leaf types say what one
//!   value may be (`Int<1, MAX_DURATION_MS>`, `HeaderName`, `StatName`, ...), so a field and
//!   its rule are written once;
//! - `Tree`, a deserializer over the parsed JSON, reports where a value was refused
//!   (`limits[0].requests_per_minute: must be > 0`), which is what an operator reading
//!   Envoy's log at 3 a.m. needs;
//! - `TryFrom<ConfigDto> for Config` applies the rules that relate fields (required names,
//!   duplicates, fallbacks, one kind per limit), naming the field the same way.
//!
//! When a configuration has several errors, the one reported is the first value refused in
//! the DTOs' order (unknown fields of an object first), else the first rule between fields.

use crate::classify::Dialect;
use serde::de::value::MapDeserializer;
use serde::de::{
    self, DeserializeSeed, Deserializer, IntoDeserializer, MapAccess, SeqAccess, Visitor,
};
use serde::Deserialize;
use serde_json::Value;
use std::fmt;
use std::marker::PhantomData;

pub const DEFAULT_ACCOUNT_HEADERS: [&str; 4] =
    ["x-api-key", "authorization", "api-key", "x-goog-api-key"];
const MAX_POOLS: usize = 64;
const MAX_LIMITS: usize = 64;
const MAX_ACCOUNT_HEADERS: usize = 16;
const MAX_DURATION_MS: u64 = 7 * 24 * 3600 * 1000;
const MAX_PER_MINUTE: u64 = 1_000_000_000;
const MAX_KEYS: u64 = 10_000_000;
/// Envoy's `stream_idle_timeout` is 5 minutes by default, and a held request sends nothing.
const MAX_HOLD_MS: u64 = 300_000;
const MAX_HELD: u64 = 100_000;
const MAX_IN_FLIGHT: u64 = 1_000_000;
const DEFAULT_SLOT_LEASE_MS: u64 = 600_000;
/// The output reserved for a request that sets no output limit (`default_output_tokens`).
pub const DEFAULT_OUTPUT_TOKENS: u64 = 1024;
/// The name of the implicit pool for requests that match no configured pool.
pub const DEFAULT_POOL: &str = "default";

/// A configuration error: the JSON path of the offending field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "{}: {}", self.field, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Configured pools, then the implicit `default` pool last.
    pub pools: Vec<Pool>,
    pub account_headers: Vec<String>,
    pub retry_after: RetryAfter,
    pub cooldown: Cooldown,
    pub preemptive: bool,
    pub limits: Vec<Limit>,
    pub max_keys: u64,
    pub hold: Hold,
    /// The rate-limit service several Envoys share budgets through (`limits[].scope: fleet`).
    pub fleet: Option<Fleet>,
}

/// The rate-limit service a fleet of Envoys shares its `scope: fleet` budgets through.
#[derive(Debug, Clone, PartialEq)]
pub struct Fleet {
    /// The Envoy cluster (HTTP/2) of the service.
    pub cluster: String,
    /// The RLS domain (Limitador's namespace).
    pub domain: String,
    /// How long a call may take before the fallback applies.
    pub timeout_ms: u64,
    pub on_error: OnError,
    /// Token budgets use Limitador's Reserve / Commit (false: charged at admission, topped up
    /// after, never refunded).
    pub reservations: bool,
}

/// What a fleet limit does while the service cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// This Envoy's own bucket of the same rate decides.
    Local,
    /// The request goes.
    Allow,
    /// The request is answered locally (429).
    Deny,
}

/// Where a limit is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// In this Envoy's shared data.
    Local,
    /// By the fleet's rate-limit service.
    Fleet,
}

/// The default RLS domain of fleet limits (Limitador's namespace).
pub const DEFAULT_FLEET_DOMAIN: &str = "llm_governor";
const DEFAULT_FLEET_TIMEOUT_MS: u64 = 50;
const MAX_FLEET_TIMEOUT_MS: u64 = 10_000;

/// Holding requests through short waits instead of answering them locally.
#[derive(Debug, Clone, PartialEq)]
pub struct Hold {
    /// The longest wait a request is held through; 0 turns holding off.
    pub max_ms: u64,
    /// At most this many requests held at once on one worker.
    pub max_held: u64,
    /// Taken off the client's own timeout: a held request is released or answered this long
    /// before the client would give up.
    pub margin_ms: u64,
    /// Where the client's timeout is read from, first present wins.
    pub deadline_headers: Vec<String>,
}

impl Hold {
    pub fn enabled(&self) -> bool {
        self.max_ms > 0 && self.max_held > 0
    }
}

pub const DEFAULT_DEADLINE_HEADERS: [&str; 3] = [
    "x-stainless-read-timeout",
    "x-stainless-timeout",
    "x-envoy-expected-rq-timeout-ms",
];

#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    pub name: String,
    pub matcher: Match,
    pub dialect: Dialect,
    /// Pools that can serve the same requests, in order of preference (indices into `pools`).
    pub fallback: Vec<usize>,
    /// The account of a pool whose credential Envoy injects, as a label (hashed like a
    /// credential); None: the client's own credential is the account.
    pub account: Option<String>,
}

/// All given conditions must hold; an empty match matches every request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Match {
    pub path_prefix: Option<String>,
    pub authority: Option<String>,
    pub header: Option<(String, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryAfter {
    pub default_ms: u64,
    pub max_ms: u64,
    pub jitter: f64,
    /// Tell clients twice as long per consecutive failed cooldown round (off by default: the
    /// contract's `retry-after-ms` is the provider's time plus jitter).
    pub escalate: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cooldown {
    pub enabled: bool,
    pub max_ms: u64,
    pub quota_ms: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum LimitKey {
    Header(String),
    Account,
    Pool,
    /// The request's model (the body's `model`, Azure's deployment, Gemini's model path), and
    /// with `header`, that header's value too (`header:<name>+model`).
    Model {
        header: Option<String>,
    },
}

impl LimitKey {
    /// The keying header, if any.
    pub fn header(&self) -> Option<&str> {
        match self {
            LimitKey::Header(h) | LimitKey::Model { header: Some(h) } => Some(h),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    Tokens,
    /// At most `per_minute` (the cap) requests of one key upstream at once.
    InFlight,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    pub name: String,
    pub key: LimitKey,
    pub kind: LimitKind,
    /// Requests or tokens a minute; for `InFlight`, the cap.
    pub per_minute: u64,
    pub burst: u64,
    /// `InFlight` only: how long a slot whose stream never reported its end (its VM was
    /// replaced) is counted at most.
    pub slot_lease_ms: u64,
    /// `Tokens` only: take the request's estimated input plus its output limit before
    /// forwarding and settle with the reported usage at the end (false: admit while a token
    /// is left and charge the usage after the response).
    pub reserve: bool,
    /// `Tokens` only: the output reserved for a request that sets no output limit.
    pub default_output_tokens: u64,
    /// `Tokens` that reserve: what the reservation becomes when the stream ends.
    pub settle: Settle,
    pub scope: Scope,
}

/// What a token reservation becomes at the end of its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// As the provider behind the request counts: `Reservation` for OpenAI and Azure OpenAI
    /// (their TPM limiters count at admission), `Usage` for the others.
    Auto,
    /// The usage the provider reported (the difference given back or charged), as Anthropic
    /// adjusts its output-token limits at the end of a request.
    Usage,
    /// It stays what was counted at admission, as OpenAI's TPM counts a request: the larger of
    /// the estimate and the body's characters / 4, plus its output limit, never adjusted.
    Reservation,
}

impl Limit {
    pub fn shape(&self) -> crate::bucket::Shape {
        crate::bucket::Shape {
            per_minute: self.per_minute,
            burst: self.burst,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            pools: vec![default_pool()],
            account_headers: DEFAULT_ACCOUNT_HEADERS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            retry_after: RetryAfter {
                default_ms: 1000,
                max_ms: 60_000,
                jitter: 0.2,
                escalate: false,
            },
            cooldown: Cooldown {
                enabled: true,
                max_ms: 300_000,
                quota_ms: 300_000,
            },
            preemptive: true,
            limits: Vec::new(),
            max_keys: 10_000,
            hold: Hold {
                max_ms: 10_000,
                max_held: 1000,
                margin_ms: 2000,
                deadline_headers: DEFAULT_DEADLINE_HEADERS
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            },
            fleet: None,
        }
    }
}

fn default_pool() -> Pool {
    Pool {
        name: DEFAULT_POOL.to_string(),
        matcher: Match::default(),
        dialect: Dialect::Auto,
        fallback: Vec::new(),
        account: None,
    }
}

/// Parse and validate the plugin configuration. Empty input and `{}` give the defaults.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Config::default());
    }
    // Syntax first, as a whole: a truncated file is "not valid JSON", whatever its first
    // field holds. (A key given twice keeps its last value, as JSON parsers do.)
    let root: Value =
        serde_json::from_slice(bytes).map_err(|e| err("", format!("not valid JSON: {e}")))?;
    let dto = ConfigDto::deserialize(Tree(&root)).map_err(|e| ConfigError {
        field: e.path,
        reason: e.reason,
    })?;
    Config::try_from(dto)
}

// ----------------------------------------------------------------------------------------
// The configuration as written: which fields exist, in the order they are checked.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigDto {
    pools: Option<Bounded<PoolDto, MAX_POOLS>>,
    account_headers: Option<Bounded<HeaderName, MAX_ACCOUNT_HEADERS>>,
    retry_after: Option<RetryAfterDto>,
    cooldown: Option<CooldownDto>,
    preemptive: Option<Flag>,
    limits: Option<Bounded<LimitDto, MAX_LIMITS>>,
    max_keys: Option<Int<1, MAX_KEYS>>,
    hold: Option<HoldDto>,
    fleet: Option<FleetDto>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetDto {
    cluster: Option<ClusterName>,
    domain: Option<Domain>,
    timeout_ms: Option<Int<1, MAX_FLEET_TIMEOUT_MS>>,
    on_error: Option<OnErrorSpec>,
    reservations: Option<Flag>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolDto {
    name: Option<StatName>,
    r#match: Option<MatchDto>,
    dialect: Option<DialectName>,
    fallback: Option<Bounded<Text, MAX_POOLS>>,
    account: Option<Label>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MatchDto {
    path_prefix: Option<PathPrefix>,
    authority: Option<Authority>,
    header: Option<HeaderMatchDto>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderMatchDto {
    name: Option<HeaderName>,
    value: Option<Text>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RetryAfterDto {
    default_ms: Option<Int<1, MAX_DURATION_MS>>,
    max_ms: Option<Int<1, MAX_DURATION_MS>>,
    jitter: Option<Fraction>,
    escalate: Option<Flag>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CooldownDto {
    enabled: Option<Flag>,
    max_ms: Option<Int<1, MAX_DURATION_MS>>,
    quota_ms: Option<Int<1, MAX_DURATION_MS>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitDto {
    name: Option<StatName>,
    key: Option<KeySpec>,
    // Which of these may be given depends on the others, and that is said before what is
    // wrong with a value (`burst: applies to ... not max_in_flight`, not `must be > 0`).
    requests_per_minute: Option<Deferred>,
    tokens_per_minute: Option<Deferred>,
    max_in_flight: Option<Deferred>,
    burst: Option<Deferred>,
    slot_lease_ms: Option<Deferred>,
    reserve: Option<Flag>,
    default_output_tokens: Option<Deferred>,
    settle: Option<SettleSpec>,
    scope: Option<ScopeSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HoldDto {
    max_ms: Option<Int<0, MAX_HOLD_MS>>,
    max_held: Option<Int<0, MAX_HELD>>,
    margin_ms: Option<Int<0, MAX_HOLD_MS>>,
    deadline_headers: Option<Bounded<HeaderName, MAX_ACCOUNT_HEADERS>>,
}

// ----------------------------------------------------------------------------------------
// The rules between fields.

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
            pools.push(default_pool());
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
            let c = &mut cfg.hold;
            set(&mut c.max_ms, h.max_ms.map(|v| v.0));
            set(&mut c.max_held, h.max_held.map(|v| v.0));
            set(&mut c.margin_ms, h.margin_ms.map(|v| v.0));
            if let Some(Bounded(headers)) = h.deadline_headers {
                c.deadline_headers = headers.into_iter().map(|h| h.0).collect();
            }
        }
        if let Some(f) = dto.fleet {
            let Some(ClusterName(cluster)) = f.cluster else {
                return Err(err("fleet.cluster", "is required".into()));
            };
            cfg.fleet = Some(Fleet {
                cluster,
                domain: f
                    .domain
                    .map_or_else(|| DEFAULT_FLEET_DOMAIN.to_string(), |d| d.0),
                timeout_ms: f.timeout_ms.map_or(DEFAULT_FLEET_TIMEOUT_MS, |v| v.0),
                on_error: f.on_error.map_or(OnError::Local, |v| v.0),
                reservations: f.reservations.map_or(true, |v| v.0),
            });
        }
        if cfg.fleet.is_none() {
            if let Some(i) = cfg.limits.iter().position(|l| l.scope == Scope::Fleet) {
                return Err(err(
                    &format!("limits[{i}].scope"),
                    "\"fleet\" needs a \"fleet\" section (the rate-limit service's cluster)".into(),
                ));
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
    let Some(StatName(name)) = dto.name else {
        return Err(err(&format!("{at}.name"), "is required".into()));
    };
    if name == DEFAULT_POOL {
        return Err(err(
            &format!("{at}.name"),
            "\"default\" is reserved for requests that match no pool".into(),
        ));
    }
    let mut matcher = Match::default();
    if let Some(m) = dto.r#match {
        matcher.path_prefix = m.path_prefix.map(|v| v.0);
        matcher.authority = m.authority.map(|v| v.0);
        if let Some(h) = m.header {
            let hat = format!("{at}.match.header");
            let Some(HeaderName(name)) = h.name else {
                return Err(err(&format!("{hat}.name"), "is required".into()));
            };
            let Some(Text(value)) = h.value else {
                return Err(err(&format!("{hat}.value"), "is required".into()));
            };
            matcher.header = Some((name, value));
        }
    }
    let pool = Pool {
        name,
        matcher,
        dialect: dto.dialect.map_or(Dialect::Auto, |d| d.0),
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

fn limit_from(dto: LimitDto, at: &str) -> Result<Limit, ConfigError> {
    let Some(StatName(name)) = dto.name else {
        return Err(err(&format!("{at}.name"), "is required".into()));
    };
    let Some(KeySpec(key)) = dto.key else {
        return Err(err(&format!("{at}.key"), "is required".into()));
    };
    let kinds = [
        (
            dto.requests_per_minute,
            "requests_per_minute",
            LimitKind::Requests,
            MAX_PER_MINUTE,
        ),
        (
            dto.tokens_per_minute,
            "tokens_per_minute",
            LimitKind::Tokens,
            MAX_PER_MINUTE,
        ),
        (
            dto.max_in_flight,
            "max_in_flight",
            LimitKind::InFlight,
            MAX_IN_FLIGHT,
        ),
    ];
    let mut given = kinds.iter().filter(|(v, ..)| v.is_some());
    let (per_minute, kind) = match (given.next(), given.next()) {
        (Some((Some(Deferred(v)), field, kind, max)), None) => {
            let n = positive(*v, *max).map_err(|reason| err(&format!("{at}.{field}"), reason))?;
            (n, *kind)
        }
        (Some(_), Some(_)) => {
            return Err(err(
                at,
                "set one of requests_per_minute, tokens_per_minute or max_in_flight, not several"
                    .into(),
            ))
        }
        _ => {
            return Err(err(
                at,
                "one of requests_per_minute, tokens_per_minute or max_in_flight is required".into(),
            ))
        }
    };
    let burst = match dto.burst {
        Some(_) if kind == LimitKind::InFlight => {
            return Err(err(
                &format!("{at}.burst"),
                "applies to requests_per_minute and tokens_per_minute, not max_in_flight".into(),
            ))
        }
        Some(Deferred(v)) => {
            positive(v, MAX_PER_MINUTE).map_err(|reason| err(&format!("{at}.burst"), reason))?
        }
        None => per_minute,
    };
    let slot_lease_ms = match dto.slot_lease_ms {
        Some(_) if kind != LimitKind::InFlight => {
            return Err(err(
                &format!("{at}.slot_lease_ms"),
                "applies to max_in_flight limits only".into(),
            ))
        }
        Some(Deferred(v)) => int_in(v, 1000, MAX_DURATION_MS)
            .map_err(|reason| err(&format!("{at}.slot_lease_ms"), reason))?,
        None => DEFAULT_SLOT_LEASE_MS,
    };
    let tokens_only = |field: &str| {
        err(
            &format!("{at}.{field}"),
            "applies to tokens_per_minute limits only".into(),
        )
    };
    let reserving_only = |field: &str| {
        err(
            &format!("{at}.{field}"),
            "applies only when reserve is true".into(),
        )
    };
    let reserve = match dto.reserve {
        Some(_) if kind != LimitKind::Tokens => return Err(tokens_only("reserve")),
        Some(Flag(b)) => b,
        None => true,
    };
    let default_output_tokens = match dto.default_output_tokens {
        Some(_) if kind != LimitKind::Tokens => return Err(tokens_only("default_output_tokens")),
        Some(_) if !reserve => return Err(reserving_only("default_output_tokens")),
        Some(Deferred(v)) => int_in(v, 0, crate::estimate::MAX_OUTPUT)
            .map_err(|reason| err(&format!("{at}.default_output_tokens"), reason))?,
        None => DEFAULT_OUTPUT_TOKENS,
    };
    let settle = match dto.settle {
        Some(_) if kind != LimitKind::Tokens => return Err(tokens_only("settle")),
        Some(_) if !reserve => return Err(reserving_only("settle")),
        Some(SettleSpec(s)) => s,
        None => Settle::Auto,
    };
    let scope = match dto.scope {
        Some(ScopeSpec(Scope::Fleet)) if kind == LimitKind::InFlight => {
            return Err(err(
                &format!("{at}.scope"),
                "max_in_flight is exact per Envoy; a fleet-wide cap is not offered".into(),
            ))
        }
        Some(ScopeSpec(s)) => s,
        None => Scope::Local,
    };
    Ok(Limit {
        name,
        key,
        kind,
        per_minute,
        burst,
        slot_lease_ms,
        reserve,
        default_output_tokens,
        settle,
        scope,
    })
}

fn err(field: &str, reason: String) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        reason,
    }
}

// ----------------------------------------------------------------------------------------
// Leaf values: each type is one rule for one value, with the reason it gives when refused.

/// One JSON value as a leaf sees it: a scalar, or only the kind of a container. Leaves read
/// this instead of a `serde_json::Value`, so no tree is copied and no copy is dropped.
#[derive(Clone, Copy)]
enum Raw<'a> {
    Null,
    Bool(bool),
    Uint(u64),
    /// A negative integer (non-negative ones are `Uint`).
    Int(i64),
    Float(f64),
    Str(&'a str),
    Array,
    Object,
}

impl<'a> Raw<'a> {
    fn kind(self) -> &'static str {
        match self {
            Raw::Null => "null",
            Raw::Bool(_) => "a boolean",
            Raw::Uint(_) | Raw::Int(_) | Raw::Float(_) => "a number",
            Raw::Str(_) => "a string",
            Raw::Array => "an array",
            Raw::Object => "an object",
        }
    }

    fn string(self) -> Result<&'a str, String> {
        match self {
            Raw::Str(s) => Ok(s),
            other => Err(format!("must be a string, got {}", other.kind())),
        }
    }
}

impl<'de> Deserialize<'de> for Raw<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(RawVisitor)
    }
}

struct RawVisitor;

impl<'de> Visitor<'de> for RawVisitor {
    type Value = Raw<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Raw<'de>, E> {
        Ok(Raw::Null)
    }
    fn visit_none<E>(self) -> Result<Raw<'de>, E> {
        Ok(Raw::Null)
    }
    fn visit_bool<E>(self, b: bool) -> Result<Raw<'de>, E> {
        Ok(Raw::Bool(b))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Raw<'de>, E> {
        Ok(Raw::Uint(n))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Raw<'de>, E> {
        Ok(u64::try_from(n).map_or(Raw::Int(n), Raw::Uint))
    }
    fn visit_f64<E>(self, f: f64) -> Result<Raw<'de>, E> {
        Ok(Raw::Float(f))
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Raw<'de>, E> {
        Ok(Raw::Str(s))
    }
    fn visit_seq<S: SeqAccess<'de>>(self, _: S) -> Result<Raw<'de>, S::Error> {
        Ok(Raw::Array)
    }
    fn visit_map<M: MapAccess<'de>>(self, _: M) -> Result<Raw<'de>, M::Error> {
        Ok(Raw::Object)
    }
}

/// A leaf type read from one JSON value by `check`, which says why it refuses one.
macro_rules! leaf {
    ($(#[$doc:meta])* $name:ident($ty:ty) = $check:expr) => {
        $(#[$doc])*
        struct $name($ty);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let check: fn(Raw<'_>) -> Result<$ty, String> = $check;
                check(Raw::deserialize(d)?).map($name).map_err(de::Error::custom)
            }
        }
    };
}

leaf!(
    Flag(bool) = |v| match v {
        Raw::Bool(b) => Ok(b),
        other => Err(format!("must be true or false, got {}", other.kind())),
    }
);

leaf!(Text(String) = |v| v.string().map(str::to_string));

leaf!(
    SettleSpec(Settle) = |v| match v.string()? {
        "auto" => Ok(Settle::Auto),
        "usage" => Ok(Settle::Usage),
        "reservation" => Ok(Settle::Reservation),
        s => Err(format!(
            "must be \"auto\", \"usage\" or \"reservation\", got {s:?}"
        )),
    }
);

leaf!(
    ScopeSpec(Scope) = |v| match v.string()? {
        "local" => Ok(Scope::Local),
        "fleet" => Ok(Scope::Fleet),
        s => Err(format!("must be \"local\" or \"fleet\", got {s:?}")),
    }
);

leaf!(
    OnErrorSpec(OnError) = |v| match v.string()? {
        "local" => Ok(OnError::Local),
        "allow" => Ok(OnError::Allow),
        "deny" => Ok(OnError::Deny),
        s => Err(format!(
            "must be \"local\", \"allow\" or \"deny\", got {s:?}"
        )),
    }
);

leaf!(
    /// `fleet.cluster`: an Envoy cluster name (Envoy's own rule: no control characters, at
    /// most 255 bytes; whether the cluster exists is checked by the host at load).
    ClusterName(String) = |v| {
        let s = v.string()?;
        if s.is_empty() || s.len() > 255 || s.bytes().any(|b| b.is_ascii_control()) {
            Err(format!("must be an Envoy cluster name (1 to 255 printable bytes), got {s:?}"))
        } else {
            Ok(s.to_string())
        }
    }
);

leaf!(
    /// `fleet.domain`: the RLS domain (Limitador's namespace).
    Domain(String) = |v| {
        let s = v.string()?;
        if s.trim().is_empty() {
            Err("must not be empty".into())
        } else if s.len() > 255 {
            Err("must be at most 255 bytes".into())
        } else {
            Ok(s.to_string())
        }
    }
);

leaf!(
    /// `retry_after.jitter`: a fraction of the provider's time.
    Fraction(f64) = |v| {
        let j = match v {
            Raw::Uint(n) => n as f64,
            Raw::Int(n) => n as f64,
            Raw::Float(f) => f,
            _ => return Err("must be a number".into()),
        };
        if (0.0..=1.0).contains(&j) {
            Ok(j)
        } else {
            Err("must be between 0 and 1".into())
        }
    }
);

leaf!(
    /// A header name, lower-cased (Envoy hands them to the filter lower-cased).
    HeaderName(String) = |v| {
        let s = v.string()?;
        if valid_header_name(s) {
            Ok(s.to_ascii_lowercase())
        } else {
            Err(format!("not a valid header name: {s:?}"))
        }
    }
);

leaf!(
    /// Pool and limit names end up in stats names and headers: `[a-z0-9_-]{1,32}`.
    StatName(String) = |v| {
        let s = v.string()?;
        let ok = (1..=32).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if ok {
            Ok(s.to_string())
        } else {
            Err(format!("must match [a-z0-9_-]{{1,32}}, got {s:?}"))
        }
    }
);

leaf!(
    PathPrefix(String) = |v| {
        let s = v.string()?;
        if s.starts_with('/') {
            Ok(s.to_string())
        } else {
            Err("must start with '/'".into())
        }
    }
);

leaf!(
    /// Compared case-insensitively, so kept lower-cased.
    Authority(String) = |v| {
        let s = v.string()?;
        if s.is_empty() {
            Err("must not be empty".into())
        } else {
            Ok(s.to_ascii_lowercase())
        }
    }
);

leaf!(
    /// `pools[].account`: a label, hashed like a credential.
    Label(String) = |v| {
        let s = v.string()?;
        if s.trim().is_empty() {
            Err("must not be empty".into())
        } else {
            Ok(s.to_string())
        }
    }
);

leaf!(
    DialectName(Dialect) = |v| {
        let s = v.string()?;
        Dialect::parse(s).ok_or_else(|| {
            format!(
                "unknown dialect {s:?} (expected openai, anthropic, azure_openai, gemini or auto)"
            )
        })
    }
);

leaf!(
    KeySpec(LimitKey) = |v| {
        let s = v.string()?;
        match s {
            "account" => Ok(LimitKey::Account),
            "pool" => Ok(LimitKey::Pool),
            "model" => Ok(LimitKey::Model { header: None }),
            _ => match s
                .strip_prefix("header:")
                .map(|h| (h.strip_suffix("+model"), h))
            {
                Some((Some(h), _)) if valid_header_name(h) => Ok(LimitKey::Model {
                    header: Some(h.to_ascii_lowercase()),
                }),
                Some((None, h)) if valid_header_name(h) => {
                    Ok(LimitKey::Header(h.to_ascii_lowercase()))
                }
                _ => Err(format!(
                    "must be \"header:<name>\", \"header:<name>+model\", \"account\", \"pool\" \
                     or \"model\", got {s:?}"
                )),
            },
        }
    }
);

/// An integer in `MIN..=MAX`.
struct Int<const MIN: u64, const MAX: u64>(u64);

impl<'de, const MIN: u64, const MAX: u64> Deserialize<'de> for Int<MIN, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Whole::from(Raw::deserialize(d)?);
        int_in(v, MIN, MAX).map(Int).map_err(de::Error::custom)
    }
}

/// What the integer rules need to know of a value.
#[derive(Clone, Copy)]
enum Whole {
    Uint(u64),
    Negative,
    NotAnInteger,
}

impl From<Raw<'_>> for Whole {
    fn from(v: Raw<'_>) -> Whole {
        match v {
            Raw::Uint(n) => Whole::Uint(n),
            Raw::Int(_) => Whole::Negative,
            _ => Whole::NotAnInteger,
        }
    }
}

fn int_in(v: Whole, min: u64, max: u64) -> Result<u64, String> {
    match v {
        Whole::Uint(n) if (min..=max).contains(&n) => Ok(n),
        Whole::Uint(_) => Err(format!("must be between {min} and {max}")),
        _ => Err(format!("must be an integer between {min} and {max}")),
    }
}

/// A count or rate: an integer in `1..=max`.
fn positive(v: Whole, max: u64) -> Result<u64, String> {
    match v {
        Whole::Uint(0) | Whole::Negative => Err("must be > 0".into()),
        Whole::Uint(n) if n <= max => Ok(n),
        Whole::Uint(_) => Err(format!("must be <= {max}")),
        Whole::NotAnInteger => Err("must be a positive integer".into()),
    }
}

/// An integer field checked once the fields beside it are known.
struct Deferred(Whole);

impl<'de> Deserialize<'de> for Deferred {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Raw::deserialize(d).map(|v| Deferred(Whole::from(v)))
    }
}

/// An array of at most `MAX` entries (the length is checked before any entry).
struct Bounded<T, const MAX: usize>(Vec<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Deserialize<'de> for Bounded<T, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(BoundedVisitor::<T, MAX>(PhantomData))
    }
}

struct BoundedVisitor<T, const MAX: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for BoundedVisitor<T, MAX> {
    type Value = Bounded<T, MAX>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array")
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
        let too_many = || de::Error::custom(format!("at most {MAX} entries"));
        if seq.size_hint().is_some_and(|n| n > MAX) {
            return Err(too_many());
        }
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            if items.len() == MAX {
                return Err(too_many());
            }
            items.push(item);
        }
        Ok(Bounded(items))
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn valid_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

// ----------------------------------------------------------------------------------------
// The parsed JSON as a serde deserializer with this configuration's rules. serde_json's own
// (`&Value`) would take an array for a struct and visit an object's keys in sorted order;
// this one takes only an object for a struct, refuses an unknown field before it looks at any
// value, visits fields in the order the DTO declares them, and treats a null field as absent.
// It refuses unknown fields from the list the derive hands it, so the DTOs'
// `deny_unknown_fields` states the same rule for any other deserializer. It also reports the
// path itself: each level adds its segment to an error on its way out, which costs less module
// size than wrapping it in `serde_path_to_error` (about 12 KiB).

/// What went wrong and where: `path` grows at each level the error passes on its way out.
#[derive(Debug)]
struct DeError {
    path: String,
    reason: String,
}

impl DeError {
    // Errors are the cold path: one copy of each constructor, not one per DTO field.
    #[inline(never)]
    fn under(mut self, segment: Segment) -> Self {
        let rest = std::mem::take(&mut self.path);
        let sep = if rest.is_empty() || rest.starts_with('[') {
            ""
        } else {
            "."
        };
        self.path = match segment {
            Segment::Key(key) => format!("{key}{sep}{rest}"),
            Segment::Index(i) => format!("[{i}]{sep}{rest}"),
        };
        self
    }
}

enum Segment<'a> {
    Key(&'a str),
    Index(usize),
}

impl fmt::Display for DeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

impl std::error::Error for DeError {}

impl de::Error for DeError {
    #[inline(never)]
    fn custom<T: fmt::Display>(msg: T) -> Self {
        DeError {
            path: String::new(),
            reason: msg.to_string(),
        }
    }

    #[inline(never)]
    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        DeError {
            path: field.to_string(),
            reason: format!("unknown field (expected one of: {})", expected.join(", ")),
        }
    }
}

/// A present value, or `&NULL` for a field the object does not have (null is absent).
#[derive(Clone, Copy)]
struct Tree<'a>(&'a Value);

static NULL: Value = Value::Null;

impl<'de> IntoDeserializer<'de, DeError> for Tree<'de> {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

impl<'de> Deserializer<'de> for Tree<'de> {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => visitor.visit_u64(u),
                (None, Some(i), _) => visitor.visit_i64(i),
                (None, None, f) => visitor.visit_f64(f.unwrap_or(f64::NAN)),
            },
            Value::String(s) => visitor.visit_borrowed_str(s),
            Value::Array(_) => visitor.visit_seq(Items::array(self.0)?),
            // Only leaves (`Raw`) ask for an object this way, and they look at nothing inside.
            Value::Object(map) => visitor.visit_map(MapDeserializer::new(
                map.iter().map(|(k, v)| (k.as_str(), Tree(v))),
            )),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        visitor.visit_seq(Items::fields(self.0, fields)?)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_seq(Items::array(self.0)?)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        visitor.visit_newtype_struct(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct tuple tuple_struct map enum identifier ignored_any
    }
}

/// The entries of an array, or the fields of a struct; an error in one gets its segment.
struct Items<'a>(std::vec::IntoIter<(Segment<'static>, &'a Value)>);

// Out of line, and not generic: one copy serves every DTO.
impl<'a> Items<'a> {
    #[inline(never)]
    fn array(v: &'a Value) -> Result<Self, DeError> {
        let Value::Array(items) = v else {
            return Err(de::Error::custom(format!(
                "must be an array, got {}",
                kind(v)
            )));
        };
        let values: Vec<_> = items
            .iter()
            .enumerate()
            .map(|(i, v)| (Segment::Index(i), v))
            .collect();
        Ok(Items(values.into_iter()))
    }

    /// A struct is visited as the sequence of its declared fields, absent ones as null: the
    /// order is the DTO's, and the derived code has no keys to match or duplicates to catch.
    #[inline(never)]
    fn fields(v: &'a Value, fields: &'static [&'static str]) -> Result<Self, DeError> {
        let Value::Object(map) = v else {
            return Err(de::Error::custom(format!(
                "must be an object, got {}",
                kind(v)
            )));
        };
        if let Some(unknown) = map.keys().find(|k| !fields.contains(&k.as_str())) {
            return Err(de::Error::unknown_field(unknown, fields));
        }
        let values: Vec<_> = fields
            .iter()
            .map(|f| (Segment::Key(f), map.get(*f).unwrap_or(&NULL)))
            .collect();
        Ok(Items(values.into_iter()))
    }
}

impl<'de> SeqAccess<'de> for Items<'de> {
    type Error = DeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, DeError> {
        let Some((at, value)) = self.0.next() else {
            return Ok(None);
        };
        seed.deserialize(Tree(value))
            .map(Some)
            .map_err(|e| e.under(at))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::panic)]

    use super::parse;

    /// Whole messages, as Envoy's log shows them after `llm_governor: invalid configuration: `.
    #[test]
    fn messages_are_exact() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"bogus": 1}"#,
                "bogus: unknown field (expected one of: pools, account_headers, retry_after, \
                 cooldown, preemptive, limits, max_keys, hold, fleet)",
            ),
            (
                r#"{"retry_after": {"bogus": 1}}"#,
                "retry_after.bogus: unknown field (expected one of: default_ms, max_ms, jitter, \
                 escalate)",
            ),
            (
                r#"{"pools": [{"name": "a", "match": {"header": {"name": "x", "v": 1}}}]}"#,
                "pools[0].match.header.v: unknown field (expected one of: name, value)",
            ),
            ("[]", "must be an object, got an array"),
            ("null", "must be an object, got null"),
            // serde_json's own deserializer would read this array as the struct's fields.
            (
                r#"{"retry_after": [1000, 60000, 0.2, false]}"#,
                "retry_after: must be an object, got an array",
            ),
            (r#"{"pools": "a"}"#, "pools: must be an array, got a string"),
            (
                r#"{"account_headers": [null]}"#,
                "account_headers[0]: must be a string, got null",
            ),
            (
                r#"{"pools": [{"name": "a"}, {"name": 7}]}"#,
                "pools[1].name: must be a string, got a number",
            ),
            (
                r#"{"pools": [{"name": null}]}"#,
                "pools[0].name: is required",
            ),
            (
                r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 5000000000}]}"#,
                "limits[0].max_in_flight: must be <= 1000000",
            ),
            (
                r#"{"limits": [{"name": "x", "key": "pool", "max_in_flight": 2, "burst": "x"}]}"#,
                "limits[0].burst: applies to requests_per_minute and tokens_per_minute, not \
                 max_in_flight",
            ),
            (
                r#"{"limits": [{"name": "x", "key": "pool", "requests_per_minute": 1.5}]}"#,
                "limits[0].requests_per_minute: must be a positive integer",
            ),
            (
                r#"{"hold": {"deadline_headers": ["a", "b", "c", "d", "e", "f", "g", "h", "i",
                   "j", "k", "l", "m", "n", "o", "p", "q"]}}"#,
                "hold.deadline_headers: at most 16 entries",
            ),
            (
                r#"{"retry_after": {"jitter": -0.5}}"#,
                "retry_after.jitter: must be between 0 and 1",
            ),
            (
                r#"{"retry_after": {"default_ms": 5000, "max_ms": 1000}}"#,
                "retry_after.default_ms: must be <= retry_after.max_ms (1000)",
            ),
            (
                r#"{"pools": [{"name": "a", "fallback": ["b"]}, {"name": "b", "fallback": ["a"]}]}"#,
                "pools[0].fallback: cycle: \"a\" falls back to itself through other pools",
            ),
            // An unknown field is named before any value of its object is looked at, and
            // fields are checked in the DTO's order, not the file's or the alphabet's.
            (
                r#"{"hold": {"max_ms": -1, "zz": 1}}"#,
                "hold.zz: unknown field (expected one of: max_ms, max_held, margin_ms, \
                 deadline_headers)",
            ),
            (
                r#"{"account_headers": 1, "pools": 1}"#,
                "pools: must be an array, got a number",
            ),
            (
                r#"{"limits": [{"name": "a", "key": "pool", "requests_per_minute": 1, "scope": "fleet"}]}"#,
                "limits[0].scope: \"fleet\" needs a \"fleet\" section (the rate-limit service's cluster)",
            ),
            (r#"{"fleet": {}}"#, "fleet.cluster: is required"),
            (
                r#"{"fleet": {"cluster": "rls", "domain": " "}}"#,
                "fleet.domain: must not be empty",
            ),
            (
                r#"{"fleet": {"cluster": ""}}"#,
                "fleet.cluster: must be an Envoy cluster name (1 to 255 printable bytes), got \"\"",
            ),
            (
                r#"{"fleet": {"cluster": "rls", "timeout_ms": 0}}"#,
                "fleet.timeout_ms: must be between 1 and 10000",
            ),
            (
                r#"{"fleet": {"cluster": "rls", "on_error": "open"}}"#,
                "fleet.on_error: must be \"local\", \"allow\" or \"deny\", got \"open\"",
            ),
            (
                r#"{"fleet": {"cluster": "rls"}, "limits": [{"name": "a", "key": "pool", "max_in_flight": 1, "scope": "fleet"}]}"#,
                "limits[0].scope: max_in_flight is exact per Envoy; a fleet-wide cap is not offered",
            ),
            (
                r#"{"fleet": {"cluster": "rls"}, "limits": [{"name": "a", "key": "pool", "requests_per_minute": 1, "scope": "global"}]}"#,
                "limits[0].scope: must be \"local\" or \"fleet\", got \"global\"",
            ),
        ];
        for (input, want) in cases {
            match parse(input.as_bytes()) {
                Ok(_) => panic!("accepted: {input}"),
                Err(e) => assert_eq!(e.to_string(), *want, "{input}"),
            }
        }
    }

    #[test]
    fn null_is_absent_and_a_repeated_key_keeps_its_last_value() {
        let cfg = parse(br#"{"retry_after": {"max_ms": null}, "max_keys": 5, "max_keys": 7}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cfg.retry_after.max_ms, 60_000);
        assert_eq!(cfg.max_keys, 7);
    }
}
