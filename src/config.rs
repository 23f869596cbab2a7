//! The plugin configuration: JSON in, a validated `Config` out, or an error naming the field.
//!
//! Validation walks the JSON by hand rather than through serde derive so that every error can
//! name its full path (`limits[0].requests_per_minute: must be > 0`), which is what an operator
//! reading Envoy's log at 3 a.m. needs.

use crate::classify::Dialect;
use serde_json::{Map, Value};
use std::fmt;

pub const DEFAULT_ACCOUNT_HEADERS: [&str; 4] =
    ["x-api-key", "authorization", "api-key", "x-goog-api-key"];
const MAX_POOLS: usize = 64;
const MAX_LIMITS: usize = 64;
const MAX_ACCOUNT_HEADERS: usize = 16;
const MAX_DURATION_MS: u64 = 7 * 24 * 3600 * 1000;
const MAX_PER_MINUTE: u64 = 1_000_000_000;
/// Envoy's `stream_idle_timeout` is 5 minutes by default, and a held request sends nothing.
const MAX_HOLD_MS: u64 = 300_000;
const MAX_HELD: u64 = 100_000;
const MAX_IN_FLIGHT: u64 = 1_000_000;
const DEFAULT_SLOT_LEASE_MS: u64 = 600_000;
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
}

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
    let root: Value =
        serde_json::from_slice(bytes).map_err(|e| err("", format!("not valid JSON: {e}")))?;
    let mut cfg = Config::default();
    let obj = Obj::new(&root, "")?;
    obj.only(&[
        "pools",
        "account_headers",
        "retry_after",
        "cooldown",
        "preemptive",
        "limits",
        "max_keys",
        "hold",
    ])?;

    if let Some(v) = obj.get("pools") {
        let items = array(v, "pools", MAX_POOLS)?;
        let mut pools = Vec::with_capacity(items.len() + 1);
        let mut fallbacks = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let (pool, fallback) = parse_pool(item, &format!("pools[{i}]"))?;
            if pools.iter().any(|p: &Pool| p.name == pool.name) {
                return Err(err(
                    &format!("pools[{i}].name"),
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

    if let Some(v) = obj.get("account_headers") {
        let items = array(v, "account_headers", MAX_ACCOUNT_HEADERS)?;
        cfg.account_headers = items
            .iter()
            .enumerate()
            .map(|(i, v)| header_name(v, &format!("account_headers[{i}]")))
            .collect::<Result<_, _>>()?;
    }

    if let Some(v) = obj.get("retry_after") {
        let o = Obj::new(v, "retry_after")?;
        o.only(&["default_ms", "max_ms", "jitter", "escalate"])?;
        let r = &mut cfg.retry_after;
        if let Some(v) = o.get("default_ms") {
            r.default_ms = uint_in(v, "retry_after.default_ms", 1, MAX_DURATION_MS)?;
        }
        if let Some(v) = o.get("max_ms") {
            r.max_ms = uint_in(v, "retry_after.max_ms", 1, MAX_DURATION_MS)?;
        }
        if let Some(v) = o.get("jitter") {
            let j = v
                .as_f64()
                .ok_or_else(|| err("retry_after.jitter", "must be a number".into()))?;
            if !(0.0..=1.0).contains(&j) {
                return Err(err("retry_after.jitter", "must be between 0 and 1".into()));
            }
            r.jitter = j;
        }
        if let Some(v) = o.get("escalate") {
            r.escalate = boolean(v, "retry_after.escalate")?;
        }
        if r.default_ms > r.max_ms {
            return Err(err(
                "retry_after.default_ms",
                format!("must be <= retry_after.max_ms ({})", r.max_ms),
            ));
        }
    }

    if let Some(v) = obj.get("cooldown") {
        let o = Obj::new(v, "cooldown")?;
        o.only(&["enabled", "max_ms", "quota_ms"])?;
        let c = &mut cfg.cooldown;
        if let Some(v) = o.get("enabled") {
            c.enabled = boolean(v, "cooldown.enabled")?;
        }
        if let Some(v) = o.get("max_ms") {
            c.max_ms = uint_in(v, "cooldown.max_ms", 1, MAX_DURATION_MS)?;
        }
        if let Some(v) = o.get("quota_ms") {
            c.quota_ms = uint_in(v, "cooldown.quota_ms", 1, MAX_DURATION_MS)?;
        }
    }

    if let Some(v) = obj.get("preemptive") {
        cfg.preemptive = boolean(v, "preemptive")?;
    }

    if let Some(v) = obj.get("limits") {
        let items = array(v, "limits", MAX_LIMITS)?;
        for (i, item) in items.iter().enumerate() {
            let limit = parse_limit(item, &format!("limits[{i}]"))?;
            if cfg.limits.iter().any(|l| l.name == limit.name) {
                return Err(err(
                    &format!("limits[{i}].name"),
                    format!("duplicate limit name {:?}", limit.name),
                ));
            }
            cfg.limits.push(limit);
        }
    }

    if let Some(v) = obj.get("max_keys") {
        cfg.max_keys = uint_in(v, "max_keys", 1, 10_000_000)?;
    }

    if let Some(v) = obj.get("hold") {
        let o = Obj::new(v, "hold")?;
        o.only(&["max_ms", "max_held", "margin_ms", "deadline_headers"])?;
        let h = &mut cfg.hold;
        if let Some(v) = o.get("max_ms") {
            h.max_ms = uint_in(v, "hold.max_ms", 0, MAX_HOLD_MS)?;
        }
        if let Some(v) = o.get("max_held") {
            h.max_held = uint_in(v, "hold.max_held", 0, MAX_HELD)?;
        }
        if let Some(v) = o.get("margin_ms") {
            h.margin_ms = uint_in(v, "hold.margin_ms", 0, MAX_HOLD_MS)?;
        }
        if let Some(v) = o.get("deadline_headers") {
            let items = array(v, "hold.deadline_headers", MAX_ACCOUNT_HEADERS)?;
            h.deadline_headers = items
                .iter()
                .enumerate()
                .map(|(i, v)| header_name(v, &format!("hold.deadline_headers[{i}]")))
                .collect::<Result<_, _>>()?;
        }
    }
    Ok(cfg)
}

/// A pool as written, and the names its `fallback` lists (resolved once every pool is known).
fn parse_pool(v: &Value, at: &str) -> Result<(Pool, Vec<String>), ConfigError> {
    let o = Obj::new(v, at)?;
    o.only(&["name", "match", "dialect", "fallback", "account"])?;
    let name = match o.get("name") {
        Some(v) => stat_name(v, &format!("{at}.name"))?,
        None => return Err(err(&format!("{at}.name"), "is required".into())),
    };
    if name == DEFAULT_POOL {
        return Err(err(
            &format!("{at}.name"),
            "\"default\" is reserved for requests that match no pool".into(),
        ));
    }
    let mut matcher = Match::default();
    if let Some(v) = o.get("match") {
        let at = format!("{at}.match");
        let m = Obj::new(v, &at)?;
        m.only(&["path_prefix", "authority", "header"])?;
        if let Some(v) = m.get("path_prefix") {
            let s = string(v, &format!("{at}.path_prefix"))?;
            if !s.starts_with('/') {
                return Err(err(
                    &format!("{at}.path_prefix"),
                    "must start with '/'".into(),
                ));
            }
            matcher.path_prefix = Some(s.to_string());
        }
        if let Some(v) = m.get("authority") {
            let s = string(v, &format!("{at}.authority"))?;
            if s.is_empty() {
                return Err(err(&format!("{at}.authority"), "must not be empty".into()));
            }
            matcher.authority = Some(s.to_ascii_lowercase());
        }
        if let Some(v) = m.get("header") {
            let hat = format!("{at}.header");
            let h = Obj::new(v, &hat)?;
            h.only(&["name", "value"])?;
            let name = match h.get("name") {
                Some(v) => header_name(v, &format!("{hat}.name"))?,
                None => return Err(err(&format!("{hat}.name"), "is required".into())),
            };
            let value = match h.get("value") {
                Some(v) => string(v, &format!("{hat}.value"))?.to_string(),
                None => return Err(err(&format!("{hat}.value"), "is required".into())),
            };
            matcher.header = Some((name, value));
        }
    }
    let dialect = match o.get("dialect") {
        Some(v) => {
            let s = string(v, &format!("{at}.dialect"))?;
            Dialect::parse(s).ok_or_else(|| {
                err(
                    &format!("{at}.dialect"),
                    format!("unknown dialect {s:?} (expected openai, anthropic, azure_openai, gemini or auto)"),
                )
            })?
        }
        None => Dialect::Auto,
    };
    let mut fallback = Vec::new();
    if let Some(v) = o.get("fallback") {
        for (i, item) in array(v, &format!("{at}.fallback"), MAX_POOLS)?
            .iter()
            .enumerate()
        {
            fallback.push(string(item, &format!("{at}.fallback[{i}]"))?.to_string());
        }
    }
    let account = match o.get("account") {
        Some(v) => {
            let s = string(v, &format!("{at}.account"))?;
            if s.trim().is_empty() {
                return Err(err(&format!("{at}.account"), "must not be empty".into()));
            }
            Some(s.to_string())
        }
        None => None,
    };
    let pool = Pool {
        name,
        matcher,
        dialect,
        fallback: Vec::new(),
        account,
    };
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

fn parse_limit(v: &Value, at: &str) -> Result<Limit, ConfigError> {
    let o = Obj::new(v, at)?;
    o.only(&[
        "name",
        "key",
        "requests_per_minute",
        "tokens_per_minute",
        "max_in_flight",
        "burst",
        "slot_lease_ms",
    ])?;
    let name = match o.get("name") {
        Some(v) => stat_name(v, &format!("{at}.name"))?,
        None => return Err(err(&format!("{at}.name"), "is required".into())),
    };
    let key = match o.get("key") {
        Some(v) => {
            let s = string(v, &format!("{at}.key"))?;
            match s {
                "account" => LimitKey::Account,
                "pool" => LimitKey::Pool,
                _ => match s.strip_prefix("header:") {
                    Some(h) if valid_header_name(h) => LimitKey::Header(h.to_ascii_lowercase()),
                    _ => {
                        return Err(err(
                            &format!("{at}.key"),
                            format!(
                                "must be \"header:<name>\", \"account\" or \"pool\", got {s:?}"
                            ),
                        ))
                    }
                },
            }
        }
        None => return Err(err(&format!("{at}.key"), "is required".into())),
    };
    let kinds = [
        ("requests_per_minute", LimitKind::Requests, MAX_PER_MINUTE),
        ("tokens_per_minute", LimitKind::Tokens, MAX_PER_MINUTE),
        ("max_in_flight", LimitKind::InFlight, MAX_IN_FLIGHT),
    ];
    let mut given = kinds.iter().filter(|(f, _, _)| o.get(f).is_some());
    let (kind, per_minute) = match (given.next(), given.next()) {
        (Some((field, kind, max)), None) => {
            let at = format!("{at}.{field}");
            let n = positive(o.get(field).unwrap_or(&Value::Null), &at)?;
            if n > *max {
                return Err(err(&at, format!("must be <= {max}")));
            }
            (*kind, n)
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
    let burst = match o.get("burst") {
        Some(_) if kind == LimitKind::InFlight => {
            return Err(err(
                &format!("{at}.burst"),
                "applies to requests_per_minute and tokens_per_minute, not max_in_flight".into(),
            ))
        }
        Some(v) => positive(v, &format!("{at}.burst"))?,
        None => per_minute,
    };
    let slot_lease_ms = match o.get("slot_lease_ms") {
        Some(_) if kind != LimitKind::InFlight => {
            return Err(err(
                &format!("{at}.slot_lease_ms"),
                "applies to max_in_flight limits only".into(),
            ))
        }
        Some(v) => uint_in(v, &format!("{at}.slot_lease_ms"), 1000, MAX_DURATION_MS)?,
        None => DEFAULT_SLOT_LEASE_MS,
    };
    Ok(Limit {
        name,
        key,
        kind,
        per_minute,
        burst,
        slot_lease_ms,
    })
}

fn positive(v: &Value, at: &str) -> Result<u64, ConfigError> {
    match v.as_u64() {
        Some(0) => Err(err(at, "must be > 0".into())),
        Some(n) if n <= MAX_PER_MINUTE => Ok(n),
        Some(_) => Err(err(at, format!("must be <= {MAX_PER_MINUTE}"))),
        None if v.as_i64().is_some_and(|n| n <= 0) => Err(err(at, "must be > 0".into())),
        None => Err(err(at, "must be a positive integer".into())),
    }
}

fn err(field: &str, reason: String) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        reason,
    }
}

/// A JSON object being validated, with its path for error messages.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    at: &'a str,
}

impl<'a> Obj<'a> {
    fn new(v: &'a Value, at: &'a str) -> Result<Self, ConfigError> {
        match v {
            Value::Object(map) => Ok(Obj { map, at }),
            _ => Err(err(at, format!("must be an object, got {}", kind(v)))),
        }
    }

    fn only(&self, known: &[&str]) -> Result<(), ConfigError> {
        match self.map.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => {
                let field = if self.at.is_empty() {
                    k.clone()
                } else {
                    format!("{}.{k}", self.at)
                };
                Err(err(
                    &field,
                    format!("unknown field (expected one of: {})", known.join(", ")),
                ))
            }
            None => Ok(()),
        }
    }

    /// A present, non-null field.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
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

fn array<'a>(v: &'a Value, at: &str, max: usize) -> Result<&'a Vec<Value>, ConfigError> {
    let a = v
        .as_array()
        .ok_or_else(|| err(at, format!("must be an array, got {}", kind(v))))?;
    if a.len() > max {
        return Err(err(at, format!("at most {max} entries")));
    }
    Ok(a)
}

fn string<'a>(v: &'a Value, at: &str) -> Result<&'a str, ConfigError> {
    v.as_str()
        .ok_or_else(|| err(at, format!("must be a string, got {}", kind(v))))
}

fn boolean(v: &Value, at: &str) -> Result<bool, ConfigError> {
    v.as_bool()
        .ok_or_else(|| err(at, format!("must be true or false, got {}", kind(v))))
}

fn uint_in(v: &Value, at: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    match v.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        Some(_) => Err(err(at, format!("must be between {min} and {max}"))),
        None => Err(err(
            at,
            format!("must be an integer between {min} and {max}"),
        )),
    }
}

/// Pool and limit names end up in stats names and headers: `[a-z0-9_-]{1,32}`.
fn stat_name(v: &Value, at: &str) -> Result<String, ConfigError> {
    let s = string(v, at)?;
    let ok = (1..=32).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(s.to_string())
    } else {
        Err(err(at, format!("must match [a-z0-9_-]{{1,32}}, got {s:?}")))
    }
}

fn valid_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn header_name(v: &Value, at: &str) -> Result<String, ConfigError> {
    let s = string(v, at)?;
    if valid_header_name(s) {
        Ok(s.to_ascii_lowercase())
    } else {
        Err(err(at, format!("not a valid header name: {s:?}")))
    }
}
