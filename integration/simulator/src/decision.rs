//! What the simulator decided for one provider request, and why: the value the simulator's
//! state (`sim`) hands to the dialects (`providers`) to answer with.

use serde::Serialize;

use crate::dialect::Dialect;
use crate::scenario::{Dimension, RetryStyle};

/// What a provider request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    RateLimited,
    Quota,
    Overloaded,
    Unavailable,
    GeminiMinute,
    GeminiDay,
    Error(u16),
}

impl Outcome {
    pub fn status(self, dialect: Dialect) -> u16 {
        match self {
            Outcome::Ok => 200,
            Outcome::RateLimited | Outcome::Quota | Outcome::GeminiMinute | Outcome::GeminiDay => {
                429
            }
            Outcome::Overloaded if dialect == Dialect::Anthropic => 529,
            Outcome::Overloaded | Outcome::Unavailable => 503,
            Outcome::Error(s) => s,
        }
    }
}

/// Why a provider request got its answer; logged as `decision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Answered with success: not targeted, or targeted and within every limit.
    Ok,
    /// The sliding `limit` window was over its `requests`.
    WindowFull,
    /// `max_concurrency` requests of the key were already in flight.
    Concurrency,
    /// The key's `tpm` bucket did not hold the request's count (yet).
    TokensExhausted,
    /// The request's count is over the `tpm` capacity: it never fits.
    TokensTooLarge,
    /// The key's `itpm` bucket did not hold its uncached input and cache writes.
    InputTokensExhausted,
    /// The key's `otpm` bucket had no token left (output is counted as generated).
    OutputTokensExhausted,
    /// The key's `rpd` or `tpd` bucket did not hold the request.
    DayExhausted,
    /// The scenario's `mode` applies (no `limit`, mode other than `ok`).
    Mode,
    /// Not a `POST`: 405.
    MethodNotAllowed,
}

impl Reason {
    pub fn is_rejection(self) -> bool {
        matches!(
            self,
            Reason::WindowFull
                | Reason::Concurrency
                | Reason::Mode
                | Reason::TokensExhausted
                | Reason::TokensTooLarge
                | Reason::InputTokensExhausted
                | Reason::OutputTokensExhausted
                | Reason::DayExhausted
        )
    }
}

/// Rate-limit values reported in headers, fully resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Limits {
    pub limit_requests: u64,
    pub remaining_requests: u64,
    pub reset_requests_ms: u64,
    pub limit_tokens: u64,
    pub remaining_tokens: u64,
    pub reset_tokens_ms: u64,
    pub limit_input_tokens: u64,
    pub remaining_input_tokens: u64,
    pub reset_input_tokens_ms: u64,
    pub limit_output_tokens: u64,
    pub remaining_output_tokens: u64,
    pub reset_output_tokens_ms: u64,
}

#[derive(Debug, Clone)]
pub struct Decision {
    pub reason: Reason,
    pub outcome: Outcome,
    pub status: u16,
    /// When the client may come back, in ms (the "retry hint").
    pub hint_ms: u64,
    /// The scenario's `retry_after`, if it set one.
    pub style: Option<RetryStyle>,
    /// The dimension reported exhausted (rate-limited outcomes only).
    pub exhausted: Option<Dimension>,
    pub limits: Limits,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Anthropic's prompt cache: tokens read from it and written to it (`sim::prompt_cache`).
    pub cache_read_tokens: u64,
    pub cache_creation_tokens: u64,
    /// The `tpm` count of a targeted request, and the tokens in use when it came.
    pub tokens: Option<TokenUse>,
    pub latency_ms: u64,
    pub stream_delay_ms: u64,
    pub now_unix_ms: u64,
    /// The request is counted in flight: call `State::finish` with its key once the answer is
    /// written. Only served requests (`Reason::Ok`) are: a real provider's 429 holds no slot,
    /// while here it may wait out `latency_ms` too.
    pub in_flight: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenUse {
    /// The bucket's capacity (`tpm.tokens`).
    pub limit: u64,
    /// Estimated input + the output limit (or the completion the simulator will report).
    pub counted: u64,
    /// Capacity minus the whole tokens left, before this request.
    pub used: u64,
}
