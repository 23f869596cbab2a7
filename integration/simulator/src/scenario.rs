//! The scenario: what the simulated provider answers. Set with `POST /_sim/scenario` or
//! `--scenario`. Unknown fields, wrong types and out-of-range values are rejected.

use serde::{Deserialize, Serialize};

use crate::tpm;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Ok,
    RateLimited,
    Quota,
    Overloaded,
    Unavailable,
    GeminiMinute,
    GeminiDay,
    Error,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryStyle {
    Seconds,
    Ms,
    Date,
    None,
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dimension {
    #[default]
    Requests,
    Tokens,
    InputTokens,
    OutputTokens,
}

impl Dimension {
    pub fn is_tokens(self) -> bool {
        self != Dimension::Requests
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    pub requests: u64,
    pub window_ms: u64,
}

/// A per-key token bucket (OpenAI's TPM): `tokens` of capacity, refilled at `tokens` per minute.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tpm {
    pub tokens: u64,
}

/// A per-key bucket of requests per day (OpenAI's RPD), refilled evenly over the day.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rpd {
    pub requests: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitValues {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_requests: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining_requests: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset_requests_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset_tokens_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining_input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_output_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining_output_tokens: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    /// Each answer's output drawn uniformly from [min, max] (an agent's short answers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens_range: Option<(u64, u64)>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    #[serde(default)]
    pub mode: Mode,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<RetryStyle>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<f64>,
    /// An outage inside a scenario that keeps its `limit` window: until this moment (ms since
    /// the scenario started) every targeted request is answered as `mode` says (a 429 with
    /// `retry_after_s` for `rate_limited`) and counted in the window like any other; the
    /// answers' reset of the exhausted dimension tells the true rest of the outage, whatever
    /// `retry_after_s` says. Afterwards the window decides.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub down_until_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<Limit>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpm: Option<Tpm>,
    /// Anthropic's input tokens per minute: uncached input plus cache writes (`sim::meters`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itpm: Option<Tpm>,
    /// Anthropic's output tokens per minute: the tokens generated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otpm: Option<Tpm>,
    /// OpenAI's requests per day.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rpd: Option<Rpd>,
    /// OpenAI's tokens per day, counted as its TPM counts them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpd: Option<Tpm>,
    /// Most requests of one account key in flight at once; a targeted request arriving when
    /// this many are already in flight gets a 429.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratelimit: Option<RateLimitValues>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dimension: Option<Dimension>,
    /// Extension: delay between streamed (SSE) events, default 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_delay_ms: Option<u64>,
}

impl Scenario {
    /// Parses and validates a scenario. An empty body is the default scenario.
    pub fn parse(body: &[u8]) -> Result<Scenario, String> {
        if body.iter().all(|b| b.is_ascii_whitespace()) {
            return Ok(Scenario::default());
        }
        let s: Scenario =
            serde_json::from_slice(body).map_err(|e| format!("invalid scenario: {e}"))?;
        s.validate()?;
        Ok(s)
    }

    pub fn validate(&self) -> Result<(), String> {
        if let Some(st) = self.status {
            if !(400..=599).contains(&st) {
                return Err("invalid scenario: status: must be within 400..=599".into());
            }
        }
        if let Some(r) = self.retry_after_s {
            if !r.is_finite() || !(0.0..=86_400.0 * 366.0).contains(&r) {
                return Err(
                    "invalid scenario: retry_after_s: must be a number of seconds >= 0".into(),
                );
            }
        }
        if let Some(u) = self.until_ms {
            if !u.is_finite() || u < 0.0 {
                return Err("invalid scenario: until_ms: must be >= 0".into());
            }
        }
        if let Some(u) = self.down_until_ms {
            if !u.is_finite() || u < 0.0 {
                return Err("invalid scenario: down_until_ms: must be >= 0".into());
            }
        }
        if let Some(l) = &self.limit {
            if l.requests == 0 {
                return Err("invalid scenario: limit.requests: must be > 0".into());
            }
            if l.window_ms == 0 {
                return Err("invalid scenario: limit.window_ms: must be > 0".into());
            }
        }
        if let Some(t) = &self.tpm {
            if !(1..=tpm::MAX_CAPACITY).contains(&t.tokens) {
                return Err(format!(
                    "invalid scenario: tpm.tokens: must be within 1..={}",
                    tpm::MAX_CAPACITY
                ));
            }
        }
        for (name, meter) in [
            ("itpm", &self.itpm),
            ("otpm", &self.otpm),
            ("tpd", &self.tpd),
        ] {
            if meter
                .as_ref()
                .is_some_and(|t| !(1..=tpm::MAX_CAPACITY).contains(&t.tokens))
            {
                return Err(format!(
                    "invalid scenario: {name}.tokens: must be within 1..={}",
                    tpm::MAX_CAPACITY
                ));
            }
        }
        if self
            .rpd
            .as_ref()
            .is_some_and(|r| !(1..=tpm::MAX_CAPACITY).contains(&r.requests))
        {
            return Err(format!(
                "invalid scenario: rpd.requests: must be within 1..={}",
                tpm::MAX_CAPACITY
            ));
        }
        if let Some((lo, hi)) = self.usage.as_ref().and_then(|u| u.output_tokens_range) {
            if lo > hi {
                return Err("invalid scenario: usage.output_tokens_range: min > max".into());
            }
        }
        if self.max_concurrency == Some(0) {
            return Err("invalid scenario: max_concurrency: must be > 0".into());
        }
        if self.latency_ms.is_some_and(|v| v > 600_000) {
            return Err("invalid scenario: latency_ms: must be <= 600000".into());
        }
        if self.stream_delay_ms.is_some_and(|v| v > 60_000) {
            return Err("invalid scenario: stream_delay_ms: must be <= 60000".into());
        }
        Ok(())
    }

    /// The status used by mode "error" (default 500).
    pub fn error_status(&self) -> u16 {
        self.status.unwrap_or(500)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_full_scenario() {
        let s = Scenario::parse(
            br#"{"mode":"rate_limited","retry_after":"both","retry_after_s":2.5,"count":3,
                "until_ms":2000,"keys":["sk-a"],"limit":{"requests":5,"window_ms":3000},
                "max_concurrency":4,"latency_ms":10,"dimension":"input_tokens",
                "ratelimit":{"limit_requests":60,"remaining_requests":42,"reset_requests_ms":1000,
                  "limit_tokens":100000,"remaining_tokens":99000,"reset_tokens_ms":6000,
                  "limit_input_tokens":80000,"remaining_input_tokens":79000,
                  "limit_output_tokens":20000,"remaining_output_tokens":19000},
                "usage":{"input_tokens":12,"output_tokens":30}}"#,
        )
        .unwrap();
        assert_eq!(s.mode, Mode::RateLimited);
        assert_eq!(s.retry_after, Some(RetryStyle::Both));
        assert_eq!(s.limit.as_ref().map(|l| l.requests), Some(5));
        assert_eq!(s.dimension, Some(Dimension::InputTokens));
        assert_eq!(s.max_concurrency, Some(4));
        assert_eq!(s.latency_ms, Some(10));
        assert_eq!(s.ratelimit.unwrap().remaining_requests, Some(42));
    }

    #[test]
    fn defaults() {
        assert_eq!(Scenario::parse(b"").unwrap(), Scenario::default());
        assert_eq!(Scenario::parse(b"{}").unwrap().mode, Mode::Ok);
        let s = Scenario::parse(br#"{"mode":"error","status":401}"#).unwrap();
        assert_eq!(s.error_status(), 401);
    }

    #[test]
    fn rejects_unknown_fields_and_bad_values() {
        let e = Scenario::parse(br#"{"mode":"ok","bogus":1}"#).unwrap_err();
        assert!(e.contains("unknown field `bogus`"), "{e}");
        let e = Scenario::parse(br#"{"limit":{"requests":5,"window_ms":3000,"x":1}}"#).unwrap_err();
        assert!(e.contains("unknown field `x`"), "{e}");
        let e = Scenario::parse(br#"{"ratelimit":{"limit_request":1}}"#).unwrap_err();
        assert!(e.contains("unknown field"), "{e}");
        assert!(Scenario::parse(br#"{"mode":"sideways"}"#).is_err());
        assert!(Scenario::parse(br#"{"retry_after":"weeks"}"#).is_err());
        assert!(Scenario::parse(br#"{"count":"3"}"#).is_err());
        assert!(Scenario::parse(br#"{"limit":{"requests":0,"window_ms":1}}"#).is_err());
        assert!(Scenario::parse(br#"{"mode":"error","status":200}"#).is_err());
        assert!(Scenario::parse(br#"{"retry_after_s":-1}"#).is_err());
        assert!(Scenario::parse(b"[1,2]").is_err());
        assert!(Scenario::parse(b"{").is_err());
    }

    #[test]
    fn tpm_is_validated() {
        let s = Scenario::parse(br#"{"tpm":{"tokens":20000}}"#).unwrap();
        assert_eq!(s.tpm, Some(Tpm { tokens: 20000 }));
        assert_eq!(serde_json::to_value(&s).unwrap()["tpm"]["tokens"], 20000);
        assert!(serde_json::to_value(Scenario::default())
            .unwrap()
            .get("tpm")
            .is_none());
        for (bad, says) in [
            (
                &br#"{"tpm":{"tokens":0}}"#[..],
                "tpm.tokens: must be within",
            ),
            (
                br#"{"tpm":{"tokens":1000000001}}"#,
                "tpm.tokens: must be within",
            ),
            (br#"{"tpm":{"tokens":-1}}"#, "invalid scenario"),
            (br#"{"tpm":{"tokens":"20000"}}"#, "invalid scenario"),
            (br#"{"tpm":{}}"#, "missing field `tokens`"),
            (
                br#"{"tpm":{"tokens":1,"window_ms":1}}"#,
                "unknown field `window_ms`",
            ),
        ] {
            let e = Scenario::parse(bad).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn max_concurrency_is_validated() {
        let e = Scenario::parse(br#"{"max_concurrency":0}"#).unwrap_err();
        assert!(e.contains("max_concurrency: must be > 0"), "{e}");
        for bad in [
            &br#"{"max_concurrency":-1}"#[..],
            br#"{"max_concurrency":1.5}"#,
            br#"{"max_concurrency":"2"}"#,
            br#"{"max_concurrency":null,"max_concurency":2}"#,
        ] {
            assert!(
                Scenario::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let s = Scenario::parse(br#"{"max_concurrency":1,"latency_ms":600000}"#).unwrap();
        assert_eq!(s.max_concurrency, Some(1));
        // It round-trips through GET /_sim/scenario, and is omitted when unset.
        let doc = serde_json::to_value(&s).unwrap();
        assert_eq!(doc["max_concurrency"], 1);
        let unset = serde_json::to_value(Scenario::default()).unwrap();
        assert!(unset.get("max_concurrency").is_none());
        assert!(Scenario::parse(br#"{"latency_ms":600001}"#).is_err());
    }
}
