//! What clients see: the governed headers, and the bodies of locally generated answers.

use crate::blocked::Blocked;
use crate::classify::{Class, Dialect};
use crate::config::Config;
use crate::cooldowns::Cooldowns;
use crate::env::Env;
use crate::metrics::{Counter, Histogram};
use crate::request::{Flow, STEERING_HEADER};
use crate::retry_after;

/// Who answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerSource {
    /// The provider answered; the filter rewrote the headers.
    Upstream,
    /// Answered locally because the provider is cooling this (pool, account).
    Cooldown,
    /// Answered locally because a local bucket is empty.
    Limit,
}

impl AnswerSource {
    pub fn as_str(self) -> &'static str {
        match self {
            AnswerSource::Upstream => "upstream",
            AnswerSource::Cooldown => "cooldown",
            AnswerSource::Limit => "limit",
        }
    }
}

/// The headers every governed answer carries, in order.
pub fn governed_headers(
    class: Class,
    source: AnswerSource,
    delay_ms: u64,
) -> Vec<(&'static str, String)> {
    retry_headers(class, source, delay_ms, class.should_retry())
}

/// `governed_headers`, saying whether to retry explicitly (a retry that will be steered to a
/// fallback with room is worth making whatever the class).
pub fn retry_headers(
    class: Class,
    source: AnswerSource,
    delay_ms: u64,
    should_retry: bool,
) -> Vec<(&'static str, String)> {
    let (ms, secs) = retry_after::header_values(delay_ms);
    vec![
        ("retry-after-ms", ms),
        ("retry-after", secs),
        ("x-should-retry", should_retry.to_string()),
        ("x-llm-governor-class", class.as_str().to_string()),
        ("x-llm-governor-source", source.as_str().to_string()),
    ]
}

/// The IETF rate-limit fields of an empty local bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitFields {
    pub name: String,
    pub quota: u64,
    pub window_s: u64,
    pub remaining: u64,
    pub reset_s: u64,
}

/// What a local answer says before it is written out: its class and source, the delay it
/// tells, the counter it counts under and, for an empty bucket, its rate-limit fields.
struct LocalAnswer {
    class: Class,
    source: AnswerSource,
    delay_ms: u64,
    counter: Counter,
    fields: Option<LimitFields>,
}

impl LocalAnswer {
    /// The provider is cooling (or pacing) the (pool, account).
    fn cooldown(class: Class, delay_ms: u64) -> LocalAnswer {
        LocalAnswer {
            class,
            source: AnswerSource::Cooldown,
            delay_ms,
            counter: Counter::LocalRejectCooldown,
            fields: None,
        }
    }

    /// A local limit is empty or full.
    fn limit(delay_ms: u64, fields: Option<LimitFields>) -> LocalAnswer {
        LocalAnswer {
            class: Class::RateLimited,
            source: AnswerSource::Limit,
            delay_ms,
            counter: Counter::LocalRejectLimit,
            fields,
        }
    }
}

/// A locally generated answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
    /// Envoy's response code details (`%RESPONSE_CODE_DETAILS%`): why the gateway answered.
    pub details: &'static str,
}

/// The response code details of local answers, one per cause (the provider's own answers say
/// `via_upstream`).
pub const DETAILS_COOLDOWN: &str = "llm_governor_cooldown";
pub const DETAILS_QUOTA: &str = "llm_governor_quota";
pub const DETAILS_LIMIT: &str = "llm_governor_limit";
pub const DETAILS_RESERVED_HEADER: &str = "llm_governor_reserved_header";

impl LocalReply {
    /// Mark an answer to a request the gateway held for `ms` before answering it.
    pub fn held(&mut self, ms: u64) {
        self.headers.push((HELD_MS_HEADER, ms.to_string()));
    }
}

/// On every response to a request the gateway held: how long it held it.
pub const HELD_MS_HEADER: &str = "x-llm-governor-held-ms";
/// With `hold.classes`, on every response to a request the gateway held and on every local
/// answer: the request's hold class.
pub const HOLD_CLASS_HEADER: &str = "x-llm-governor-hold-class";

/// What Envoy's access log can read of a governed answer, as filter state: the header each
/// field is copied from, and its key (`%FILTER_STATE(wasm.llm_governor.class:PLAIN)%`, ...).
/// Part of the observability contract.
pub const ACCESS_LOG_FIELDS: [(&str, &str); 6] = [
    ("x-llm-governor-class", "llm_governor.class"),
    ("x-llm-governor-source", "llm_governor.source"),
    ("retry-after-ms", "llm_governor.delay_ms"),
    (HELD_MS_HEADER, "llm_governor.held_ms"),
    (STEERING_HEADER, "llm_governor.pool"),
    (HOLD_CLASS_HEADER, "llm_governor.hold_class"),
];

/// With `hold.classes`, the header naming the flow's hold class.
pub fn hold_class(cfg: &Config, flow: &Flow) -> Option<(&'static str, String)> {
    let classes = &cfg.hold.classes;
    let class = classes.get(flow.hold_class).filter(|_| classes.len() > 1)?;
    Some((HOLD_CLASS_HEADER, class.name.clone()))
}

/// The access-log fields (filter-state key, value) that `headers` carry.
pub fn access_log(headers: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    ACCESS_LOG_FIELDS
        .iter()
        .filter_map(|(name, key)| {
            let (_, v) = headers.iter().find(|(n, _)| n == name)?;
            Some((*key, v.clone()))
        })
        .collect()
}

/// The answer to a request that carried the steering header when the host could not remove
/// it: refused, so a client can never pick its own pool (and with it the credential).
pub fn reserved_header() -> LocalReply {
    LocalReply {
        status: 400,
        headers: Vec::new(),
        body: format!("{STEERING_HEADER} is reserved\n").into_bytes(),
        details: DETAILS_RESERVED_HEADER,
    }
}

pub fn local_reply(
    dialect: Dialect,
    class: Class,
    source: AnswerSource,
    delay_ms: u64,
    limit: Option<&LimitFields>,
) -> LocalReply {
    let mut headers = governed_headers(class, source, delay_ms);
    headers.push(("content-type", "application/json".to_string()));
    if let Some(l) = limit {
        headers.push((
            "ratelimit-policy",
            format!("\"{}\";q={};w={}", l.name, l.quota, l.window_s),
        ));
        headers.push((
            "ratelimit",
            format!("\"{}\";r={};t={}", l.name, l.remaining, l.reset_s),
        ));
    }
    let message = message(class, source, delay_ms, limit);
    let details = match (source, class) {
        (_, Class::QuotaExhausted) => DETAILS_QUOTA,
        (AnswerSource::Limit, _) => DETAILS_LIMIT,
        _ => DETAILS_COOLDOWN,
    };
    LocalReply {
        status: 429,
        headers,
        body: body(dialect, class, &message),
        details,
    }
}

/// The answer to a request that reserves more tokens than local limit `name` (`quota` per
/// `window_s`) can ever hold: a 429 whose client is told not to retry (the request must change,
/// not wait).
pub fn too_large(
    dialect: Dialect,
    name: &str,
    (quota, window_s): (u64, u64),
    message: &str,
) -> LocalReply {
    let class = Class::RateLimited;
    let mut headers = retry_headers(class, AnswerSource::Limit, 60_000, false);
    headers.push(("content-type", "application/json".to_string()));
    headers.push((
        "ratelimit-policy",
        format!("\"{name}\";q={quota};w={window_s}"),
    ));
    LocalReply {
        status: 429,
        headers,
        body: body(dialect, class, message),
        details: DETAILS_LIMIT,
    }
}

fn message(
    class: Class,
    source: AnswerSource,
    delay_ms: u64,
    limit: Option<&LimitFields>,
) -> String {
    match (source, limit) {
        (AnswerSource::Limit, Some(l)) => format!(
            "llm_governor: local limit {:?} is exhausted; retry after {delay_ms} ms",
            l.name
        ),
        // A full `max_in_flight` cap (this Envoy's or the fleet's): the provider said nothing.
        (AnswerSource::Limit, None) => format!(
            "llm_governor: a local max_in_flight limit is full; answered at the gateway; \
             retry after {delay_ms} ms"
        ),
        _ if class == Class::QuotaExhausted => {
            "llm_governor: the provider reported this account's quota or spend limit as exhausted; \
             retrying will not help until it is raised"
                .to_string()
        }
        _ => format!(
            "llm_governor: the provider asked this account to wait ({}); answered at the gateway; \
             retry after {delay_ms} ms",
            class.as_str()
        ),
    }
}

fn body(dialect: Dialect, class: Class, message: &str) -> Vec<u8> {
    let value = match dialect {
        // A local answer is always a 429, which Anthropic's API calls a rate_limit_error
        // whatever the reason; x-llm-governor-class carries the class.
        Dialect::Anthropic => {
            serde_json::json!({"type": "error", "error": {"type": "rate_limit_error", "message": message}})
        }
        Dialect::Gemini => serde_json::json!({"error": {
            "code": 429,
            "message": message,
            "status": "RESOURCE_EXHAUSTED",
        }}),
        Dialect::OpenAi | Dialect::AzureOpenAi | Dialect::Auto => {
            let code = match class {
                Class::QuotaExhausted => "insufficient_quota",
                Class::RateLimited => "rate_limit_exceeded",
                Class::Overloaded => "overloaded",
            };
            let kind = if class == Class::QuotaExhausted {
                "insufficient_quota"
            } else {
                "rate_limit_error"
            };
            serde_json::json!({"error": {"type": kind, "code": code, "message": message, "param": null}})
        }
    };
    value.to_string().into_bytes()
}

/// Local answers under a configuration.
#[derive(Clone, Copy)]
pub struct Replies<'a> {
    cfg: &'a Config,
    cooldowns: Cooldowns<'a>,
}

impl<'a> Replies<'a> {
    pub fn new(cfg: &'a Config, cooldowns: Cooldowns<'a>) -> Replies<'a> {
        Replies { cfg, cooldowns }
    }

    /// The local answer for a request that cannot go now (and is not, or no longer, held).
    pub fn reply_for(&self, flow: &Flow, blocked: &Blocked, env: &mut Env) -> LocalReply {
        let ra = &self.cfg.retry_after;
        let answer = match *blocked {
            Blocked::Cooling {
                class,
                remaining_ms,
            } => {
                let rec = self.cooldowns.record(flow, env);
                let (period, spread, streak) =
                    rec.map_or((0, 0, 0), |r| (r.period_ms, r.spread_ms, r.streak));
                // After failed rounds (with `escalate`), clients wait the extra periods the
                // upstream answers told them. The jitter is a fraction of the episode's period,
                // not of what is left: clients answered late in a cooldown would otherwise all
                // come back within a few milliseconds of the deadline and collide there.
                let extra = self.cooldowns.stretch(streak) - 1;
                let wait = remaining_ms.saturating_add(u64::from(period).saturating_mul(extra));
                LocalAnswer::cooldown(
                    class,
                    retry_after::told(wait, u64::from(spread), ra, env.rng),
                )
            }
            Blocked::Paced { retry_in_ms } => LocalAnswer::cooldown(
                Class::RateLimited,
                retry_after::told(retry_in_ms, retry_in_ms, ra, env.rng),
            ),
            // Another Envoy sends for this account now: its turn lasts about a turn's length.
            Blocked::Turn { .. } => {
                let turn = crate::fleet::turn::TURN_MS;
                LocalAnswer::cooldown(
                    Class::RateLimited,
                    retry_after::told(turn, turn, ra, env.rng),
                )
            }
            Blocked::Fleet { limit, wait_ms } => self.limit_answer(limit, wait_ms, 0),
            Blocked::Bucket {
                limit,
                wait_ms,
                remaining,
            } => self.limit_answer(limit, wait_ms, remaining),
            // Told exactly the time left, without jitter: its clients are told not to retry.
            Blocked::Quota { remaining_ms } => LocalAnswer {
                counter: Counter::LocalRejectQuota,
                ..LocalAnswer::cooldown(
                    Class::QuotaExhausted,
                    retry_after::told(remaining_ms, 0, ra, env.rng),
                )
            },
            Blocked::TooLarge { limit, tokens } => {
                return self.too_large(flow, limit, tokens, env);
            }
            // A slot frees when some stream ends, which no header foretells: the configured
            // base delay, with jitter so the returning clients spread out.
            Blocked::InFlight { .. } | Blocked::Slot { .. } => LocalAnswer::limit(
                retry_after::told(ra.default_ms, ra.default_ms, ra, env.rng),
                None,
            ),
        };
        let LocalAnswer {
            class,
            source,
            delay_ms: delay,
            counter,
            fields,
        } = answer;
        env.metrics.count(flow.pool, counter);
        env.metrics
            .histogram(flow.pool, Histogram::RetryAfterMs, delay);
        let mut reply = local_reply(flow.dialect, class, source, delay, fields.as_ref());
        if let Some(held) = flow.held_ms {
            reply.held(held);
        }
        reply.headers.extend(hold_class(self.cfg, flow));
        reply
    }

    /// An empty (or refusing) bucket of limit `limit`: the wait and the IETF rate-limit fields.
    fn limit_answer(&self, limit: usize, wait_ms: u64, remaining: u64) -> LocalAnswer {
        let l = &self.cfg.limits[limit];
        let fields = LimitFields {
            name: l.name.clone(),
            quota: l.per_window,
            window_s: l.window_s,
            remaining,
            reset_s: wait_ms.div_ceil(1000),
        };
        LocalAnswer::limit(wait_ms.clamp(1, self.cfg.retry_after.max_ms), Some(fields))
    }

    /// A request whose reservation no bucket of this size can ever hold: refused at once, and
    /// its client told not to retry (OpenAI answers "Request too large" the same way).
    fn too_large(&self, flow: &Flow, limit: usize, tokens: u64, env: &mut Env) -> LocalReply {
        let l = &self.cfg.limits[limit];
        env.metrics.count(flow.pool, Counter::LocalRejectLimit);
        let message = format!(
            "llm_governor: this request reserves {tokens} tokens (its estimated input, plus its \
             output limit where its provider counts that) and local limit {:?} holds at most {}; \
             it can never be admitted: lower max_tokens or shorten the prompt",
            l.name, l.burst
        );
        too_large(flow.dialect, &l.name, (l.per_window, l.window_s), &message)
    }
}
