//! Every delay source a provider offers, in the contract's order, turned into one delay.

use crate::classify::{self, Dialect};
use crate::config::RetryAfter;
use crate::headers::Headers;
use crate::ratelimit::{Dimension, Snapshot};
use crate::time;

/// Where a provider's delay came from (for logs and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    RetryAfterMs,
    RetryAfter,
    ResetHeader(Dimension),
    GeminiRetryInfo,
}

/// Uniform randomness in [0, 1). The host draws it from getrandom; tests fix it.
pub trait Random {
    fn unit(&mut self) -> f64;
}

/// xorshift64*: the worker's randomness, seeded once by the host (from its entropy source).
/// Jitter needs spread, not secrecy; one seed per worker keeps hostcalls off the hot path.
pub struct Xorshift(u64);

impl Xorshift {
    pub fn seeded(seed: u64) -> Xorshift {
        Xorshift(seed | 1)
    }
}

impl Random for Xorshift {
    fn unit(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (r >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The provider's own delay, from the first source that yields a positive, well-formed value:
/// `retry-after-ms`; `retry-after` as delta-seconds or HTTP-date; the reset header of the
/// exhausted dimension; Gemini `RetryInfo.retryDelay`. Zero, past and malformed values are
/// skipped, never trusted.
pub fn provider_delay(
    h: &Headers,
    body: &[u8],
    snap: &Snapshot,
    dialect: Dialect,
    now_ms: u64,
) -> Option<(u64, Source)> {
    let positive = |v: Option<u64>| v.filter(|ms| *ms > 0);
    if let Some(ms) = positive(
        h.get_str("retry-after-ms")
            .and_then(|s| time::parse_decimal_ms(s, 1)),
    ) {
        return Some((ms, Source::RetryAfterMs));
    }
    if let Some(v) = h.get_str("retry-after") {
        let ms = time::parse_decimal_ms(v, 1000)
            .or_else(|| time::parse_http_date_ms(v).and_then(|at| time::until(at, now_ms)));
        if let Some(ms) = positive(ms) {
            return Some((ms, Source::RetryAfter));
        }
    }
    if let Some(found) = exhausted_reset(snap, body, dialect) {
        return Some(found);
    }
    classify::gemini_retry_delay(body)
        .and_then(time::parse_proto_duration_ms)
        .filter(|ms| *ms > 0)
        .map(|ms| (ms, Source::GeminiRetryInfo))
}

/// The reset of the dimension that ran out. Headers that report remaining = 0 name it; an
/// OpenAI body names it in `error.type` when the request merely would not fit.
fn exhausted_reset(snap: &Snapshot, body: &[u8], dialect: Dialect) -> Option<(u64, Source)> {
    let by_header = snap
        .exhausted()
        .filter_map(|d| {
            snap.window(d)
                .reset_ms
                .filter(|ms| *ms > 0)
                .map(|ms| (ms, Source::ResetHeader(d)))
        })
        .max_by_key(|(ms, _)| *ms);
    if by_header.is_some() {
        return by_header;
    }
    if matches!(
        dialect,
        Dialect::OpenAi | Dialect::AzureOpenAi | Dialect::Auto
    ) {
        let d = classify::openai_error_dimension(body)?;
        let ms = snap.window(d).reset_ms.filter(|ms| *ms > 0)?;
        return Some((ms, Source::ResetHeader(d)));
    }
    None
}

/// `retry-after: 1` is the smallest wait whole seconds can say: when the provider's own reset
/// header for the exhausted dimension says less than a second, the wait really is that short
/// (a sliding window freeing its next slot). The cooldown then lasts until that reset, so
/// other clients are not turned away for the rest of a second the provider does not need;
/// the client that got the 429 is still told the provider's 1 s plus jitter.
pub fn sub_second_wait(h: &Headers, snap: &Snapshot) -> Option<u64> {
    if h.get_str("retry-after-ms").is_some() || h.get_str("retry-after") != Some("1") {
        return None;
    }
    snap.exhausted_reset_ms()
        .filter(|ms| (1..1000).contains(ms))
}

/// The later of a provider's stated delay and its own reset of the exhausted dimension (a
/// `retry-after: 1` in an outage whose window headers tell the true rest of it). Providers
/// document the reset as the moment the limit is whole again, which is usually later than the
/// next admission: the stated delay is believed first, this one once it has proved too short.
pub fn believed_ms(stated_ms: u64, snap: &Snapshot) -> u64 {
    snap.exhausted_reset_ms()
        .map_or(stated_ms, |reset| reset.max(stated_ms))
}

/// The dimension that ran out, for the `exhausted_*` counters.
pub fn exhausted_dimension(snap: &Snapshot, body: &[u8]) -> Option<Dimension> {
    snap.exhausted()
        .max_by_key(|d| snap.window(*d).reset_ms.unwrap_or(0))
        .or_else(|| classify::openai_error_dimension(body))
}

/// What a client is told for a provider delay: the provider's time plus up to `jitter` of it
/// on top (never below it), capped by `max_ms`, at least 1 ms.
pub fn told(provider_ms: u64, spread_ms: u64, cfg: &RetryAfter, rng: &mut dyn Random) -> u64 {
    let extra = (spread_ms as f64 * cfg.jitter * rng.unit().clamp(0.0, 1.0)) as u64;
    provider_ms.saturating_add(extra).min(cfg.max_ms).max(1)
}

/// Exponential full-jitter backoff for the `streak`-th consecutive rate limit without a hint:
/// uniform in [1, min(max_ms, default_ms * 2^streak)].
pub fn backoff(streak: u8, cfg: &RetryAfter, rng: &mut dyn Random) -> u64 {
    let ceiling = cfg
        .default_ms
        .saturating_mul(1u64 << u32::from(streak.min(30)))
        .min(cfg.max_ms);
    ((ceiling as f64 * rng.unit().clamp(0.0, 1.0)) as u64).clamp(1, ceiling.max(1))
}

/// The two header values for a delay: `retry-after-ms` and `retry-after` (seconds, rounded up).
pub fn header_values(ms: u64) -> (String, String) {
    (ms.to_string(), ms.div_ceil(1000).to_string())
}
