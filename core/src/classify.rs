//! Upstream status + headers + error body → what kind of "not now" the provider said.

use crate::headers::Headers;
use crate::ratelimit::Dimension;

/// The three kinds of "not now" a client must treat differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// A transient rate limit: waiting the provider's time helps.
    RateLimited,
    /// Quota or spend cap: retrying does not help until a human or the billing cycle acts.
    QuotaExhausted,
    /// The provider is overloaded (529, 503): transient, not the caller's fault.
    Overloaded,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::RateLimited => "rate_limited",
            Class::QuotaExhausted => "quota_exhausted",
            Class::Overloaded => "overloaded",
        }
    }

    pub fn should_retry(self) -> bool {
        self != Class::QuotaExhausted
    }

    pub fn to_byte(self) -> u8 {
        match self {
            Class::RateLimited => 1,
            Class::QuotaExhausted => 2,
            Class::Overloaded => 3,
        }
    }

    pub fn from_byte(b: u8) -> Option<Class> {
        match b {
            1 => Some(Class::RateLimited),
            2 => Some(Class::QuotaExhausted),
            3 => Some(Class::Overloaded),
            _ => None,
        }
    }
}

/// Which provider's headers and error bodies to expect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
    AzureOpenAi,
    Gemini,
    Auto,
}

impl Dialect {
    pub fn parse(s: &str) -> Option<Dialect> {
        Some(match s {
            "openai" => Dialect::OpenAi,
            "anthropic" => Dialect::Anthropic,
            "azure_openai" => Dialect::AzureOpenAi,
            "gemini" => Dialect::Gemini,
            "auto" => Dialect::Auto,
            _ => return None,
        })
    }

    /// Resolve `auto` from the request, for shaping locally generated answers: the official
    /// SDKs announce themselves (`anthropic-version`, Gemini's key header or method suffix).
    pub fn resolve_for_request(self, path: &[u8], h: &Headers) -> Dialect {
        if self != Dialect::Auto {
            return self;
        }
        if h.contains("anthropic-version") {
            Dialect::Anthropic
        } else if h.contains("x-goog-api-key") || contains(path, b":generateContent") {
            Dialect::Gemini
        } else if contains(path, b"/openai/deployments/") {
            Dialect::AzureOpenAi
        } else {
            Dialect::OpenAi
        }
    }
}

/// Only these statuses are governed; everything else passes untouched.
pub fn is_governed_status(status: u16) -> bool {
    matches!(status, 429 | 503 | 529)
}

/// A 429 can only be told apart (rate limit vs quota) by its body; 503 and 529 cannot be
/// quota, so they never need one.
pub fn needs_body(status: u16) -> bool {
    status == 429
}

/// Classify a governed response. `body` is the (possibly truncated) error body, empty when the
/// body is unavailable; a 429 whose body cannot be read is a rate limit, the safe default
/// (the client is told to wait, not to give up).
pub fn classify(status: u16, body: &[u8]) -> Option<Class> {
    match status {
        429 if is_quota_body(body) => Some(Class::QuotaExhausted),
        429 => Some(Class::RateLimited),
        503 | 529 => Some(Class::Overloaded),
        _ => None,
    }
}

/// Markers of quota and spend-cap answers. Matched as bytes so a truncated or non-UTF-8 body
/// still classifies: OpenAI `insufficient_quota`, Anthropic `enforced_spend_limit_reached`,
/// Gemini `RESOURCE_EXHAUSTED` with a per-day `QuotaFailure` violation.
fn is_quota_body(body: &[u8]) -> bool {
    contains(body, b"insufficient_quota")
        || contains(body, b"enforced_spend_limit_reached")
        || (contains(body, b"RESOURCE_EXHAUSTED") && gemini_per_day(body))
}

fn gemini_per_day(body: &[u8]) -> bool {
    // Gemini names the violated quota in `quotaId`, e.g.
    // `GenerateRequestsPerDayPerProjectPerModel-FreeTier`.
    let mut rest = body;
    while let Some(i) = find(rest, b"\"quotaId\"") {
        rest = &rest[i + 9..];
        if let Some(v) = json_string_value(rest) {
            if contains(v, b"PerDay") {
                return true;
            }
        }
    }
    false
}

/// The value of Gemini's `RetryInfo.retryDelay` (`"17s"`), if the body has one.
pub fn gemini_retry_delay(body: &[u8]) -> Option<&str> {
    let i = find(body, b"\"retryDelay\"")?;
    std::str::from_utf8(json_string_value(&body[i + 12..])?).ok()
}

/// OpenAI names the exhausted dimension in `error.type` (`requests` or `tokens`).
pub fn openai_error_dimension(body: &[u8]) -> Option<Dimension> {
    let i = find(body, b"\"type\"")?;
    match json_string_value(&body[i + 6..])? {
        b"requests" => Some(Dimension::Requests),
        b"tokens" => Some(Dimension::Tokens),
        _ => None,
    }
}

/// After a JSON key: skip `\s*:\s*` and return the raw bytes of the following string value
/// (escapes are not decoded; the values we look for contain none).
fn json_string_value(after_key: &[u8]) -> Option<&[u8]> {
    let s = trim_start(after_key);
    let s = trim_start(s.strip_prefix(b":")?);
    let s = s.strip_prefix(b"\"")?;
    let end = s.iter().position(|b| *b == b'"' || *b == b'\\')?;
    Some(&s[..end])
}

fn trim_start(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|b| b.is_ascii_whitespace()).count();
    &s[n..]
}

pub(crate) fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

pub(crate) fn contains(hay: &[u8], needle: &[u8]) -> bool {
    find(hay, needle).is_some()
}
