//! The retry hint of an answer: how each dialect carries it in headers (or, for Gemini, in the
//! body's `RetryInfo`), and what a client reads from it.

use super::secs_ceil;
use crate::decision::{Decision, Outcome, Reason};
use crate::dialect::Dialect;
use crate::http::Response;
use crate::scenario::{Dimension, RetryStyle};
use crate::timefmt::http_date_ceil_ms;

/// How an answer carries its retry hint in headers: the scenario's style or the dialect's default.
fn retry_style(dialect: Dialect, d: &Decision) -> RetryStyle {
    match d.outcome {
        // Never fits: nothing to wait for.
        _ if d.reason == Reason::TokensTooLarge => d.style.unwrap_or(RetryStyle::None),
        Outcome::RateLimited
            if dialect == Dialect::Azure
                || (dialect == Dialect::OpenAi && d.reason == Reason::TokensExhausted) =>
        {
            d.style.unwrap_or(RetryStyle::Both)
        }
        Outcome::RateLimited | Outcome::Overloaded | Outcome::Unavailable
            if dialect != Dialect::Gemini =>
        {
            d.style.unwrap_or(RetryStyle::Seconds)
        }
        // Gemini carries its hint in RetryInfo; headers only if the scenario asks.
        Outcome::RateLimited
        | Outcome::Overloaded
        | Outcome::Unavailable
        | Outcome::GeminiMinute
        | Outcome::GeminiDay => d.style.unwrap_or(RetryStyle::None),
        Outcome::Ok | Outcome::Quota | Outcome::Error(_) => RetryStyle::None,
    }
}

/// Gemini's quota shapes carry `RetryInfo` unless the scenario says `retry_after: none`.
pub fn has_retry_info(d: &Decision) -> bool {
    matches!(d.outcome, Outcome::GeminiMinute | Outcome::GeminiDay)
        && d.style != Some(RetryStyle::None)
}

/// The retry hint an answer carries, in ms, as a client reads it: from the first present of
/// `retry-after-ms`, `retry-after` (whole seconds, or an HTTP-date rounded up to the second,
/// taken relative to the answer's time), the exhausted dimension's reset header (OpenAI/Azure:
/// exact; Anthropic: RFC 3339 rounded up to the second) and Gemini's `RetryInfo.retryDelay`
/// (whole seconds). `None` when the answer carries no hint.
pub fn sent_hint_ms(dialect: Dialect, d: &Decision) -> Option<u64> {
    let whole_secs = secs_ceil(d.hint_ms).saturating_mul(1000);
    let until_second = |ms: u64| {
        d.now_unix_ms
            .saturating_add(ms)
            .div_ceil(1000)
            .saturating_mul(1000)
            .saturating_sub(d.now_unix_ms)
    };
    match retry_style(dialect, d) {
        RetryStyle::Ms | RetryStyle::Both => Some(d.hint_ms),
        RetryStyle::Seconds => Some(whole_secs),
        RetryStyle::Date => Some(until_second(d.hint_ms)),
        RetryStyle::None => match (exhausted_reset_ms(d), dialect) {
            (Some(reset), Dialect::OpenAi | Dialect::Azure) => Some(reset),
            (Some(reset), Dialect::Anthropic) => Some(until_second(reset)),
            _ if has_retry_info(d) => Some(whole_secs),
            _ => None,
        },
    }
}

/// The reset the headers carry for the exhausted dimension, in ms (a token 429 of the `tpm`
/// bucket reports the time until the bucket is full, not the hint).
fn exhausted_reset_ms(d: &Decision) -> Option<u64> {
    let l = &d.limits;
    Some(match d.exhausted? {
        Dimension::Requests => l.reset_requests_ms,
        Dimension::Tokens => l.reset_tokens_ms,
        Dimension::InputTokens => l.reset_input_tokens_ms,
        Dimension::OutputTokens => l.reset_output_tokens_ms,
    })
}

/// Adds the retry hint headers in the scenario's style.
pub fn headers(resp: &mut Response, dialect: Dialect, d: &Decision) {
    let secs = secs_ceil(d.hint_ms).to_string();
    match retry_style(dialect, d) {
        RetryStyle::Seconds => resp.header("retry-after", secs),
        RetryStyle::Ms => resp.header("retry-after-ms", d.hint_ms.to_string()),
        RetryStyle::Date => resp.header(
            "retry-after",
            http_date_ceil_ms(d.now_unix_ms.saturating_add(d.hint_ms)),
        ),
        RetryStyle::Both => {
            resp.header("retry-after", secs);
            resp.header("retry-after-ms", d.hint_ms.to_string());
        }
        RetryStyle::None => {}
    }
}
