//! The request log behind `GET /_sim/requests`: every provider request with what was decided
//! and why, and counters by status and by key that keep counting past the log's bound.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;
use serde_json::{json, Map, Value};

use super::in_flight::InFlight;
use crate::decision::Reason;

/// Most request-log entries kept (counters keep counting past it; `dropped` says how many).
pub const MAX_LOG: usize = 200_000;

#[derive(Debug, Clone, Serialize)]
pub struct LogEntry {
    pub t_ms: f64,
    pub unix_ms: u64,
    pub method: String,
    pub path: String,
    pub key: String,
    pub dialect: &'static str,
    pub status: u16,
    pub decision: Reason,
    /// The retry hint the answer carries, in ms (see `providers::sent_hint_ms`).
    pub hint_ms: Option<u64>,
    /// Requests of this key in the sliding window, this one included; `None` without a window.
    pub window_count: Option<u64>,
    /// What the `tpm` bucket counted this request as (charged only if served); `None` without
    /// `tpm` or when not targeted.
    pub counted_tokens: Option<u64>,
    /// Whole tokens left in the key's `tpm` bucket after this request.
    pub tokens_remaining: Option<u64>,
    /// The usage its answer reports (a rejected request's too: what it would have counted):
    /// uncached input, Anthropic's cache reads and writes, output.
    pub input_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_creation_tokens: u64,
    pub output_tokens: u64,
    /// Requests in flight when this one arrived, not counting itself: all keys, and this key.
    pub in_flight: u64,
    pub in_flight_key: u64,
}

#[derive(Default)]
pub struct RequestLog {
    log: VecDeque<LogEntry>,
    dropped: u64,
    total: u64,
    by_status: BTreeMap<u16, u64>,
    by_key: BTreeMap<String, BTreeMap<u16, u64>>,
}

impl RequestLog {
    pub fn record(&mut self, e: LogEntry) {
        self.total += 1;
        *self.by_status.entry(e.status).or_default() += 1;
        *self
            .by_key
            .entry(e.key.clone())
            .or_default()
            .entry(e.status)
            .or_default() += 1;
        if self.log.len() >= MAX_LOG {
            self.log.pop_front();
            self.dropped += 1;
        }
        self.log.push_back(e);
    }

    pub fn clear(&mut self) {
        *self = RequestLog::default();
    }

    /// The `GET /_sim/requests` document, `t_ms` into the scenario.
    pub fn document(&self, t_ms: f64, in_flight: &InFlight) -> Value {
        let status_map = |m: &BTreeMap<u16, u64>| -> Value {
            Value::Object(m.iter().map(|(k, v)| (k.to_string(), json!(v))).collect())
        };
        let by_key: Map<String, Value> = self
            .by_key
            .iter()
            .map(|(k, m)| (k.clone(), status_map(m)))
            .collect();
        json!({
            "total": self.total,
            "dropped": self.dropped,
            "t_ms": t_ms.round(),
            "by_status": status_map(&self.by_status),
            "by_key": by_key,
            "in_flight": in_flight.now(),
            "max_in_flight": in_flight.max(),
            "max_in_flight_by_key": in_flight.max_by_key(),
            "requests": self.log,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, SystemTime};

    use crate::dialect::Dialect;
    use crate::sim::testing::{info, last, scenario};
    use crate::sim::State;

    #[test]
    fn decision_and_sent_hint_are_logged() {
        use Dialect::*;
        // 250 ms past a whole second, so date-rounded hints are visibly rounded.
        let sys = SystemTime::UNIX_EPOCH + Duration::from_millis(1_790_000_000_250);
        let rl = r#"{"mode":"rate_limited","retry_after_s":1.25"#;
        let rows: Vec<(String, Dialect, &str, u64, Option<u64>)> = vec![
            ("{}".into(), OpenAi, "ok", 200, None),
            (format!("{rl}}}"), OpenAi, "mode", 429, Some(2000)),
            (
                format!(r#"{rl},"retry_after":"ms"}}"#),
                OpenAi,
                "mode",
                429,
                Some(1250),
            ),
            (
                format!(r#"{rl},"retry_after":"both"}}"#),
                OpenAi,
                "mode",
                429,
                Some(1250),
            ),
            // retry-after: <date> rounded up to the second: .250 + 1.250 -> 2.000, 1750 ms on.
            (
                format!(r#"{rl},"retry_after":"date"}}"#),
                OpenAi,
                "mode",
                429,
                Some(1750),
            ),
            // No retry header: the exhausted dimension's reset says it.
            (
                format!(r#"{rl},"retry_after":"none"}}"#),
                OpenAi,
                "mode",
                429,
                Some(1250),
            ),
            (
                format!(r#"{rl},"retry_after":"none"}}"#),
                Anthropic,
                "mode",
                429,
                Some(1750),
            ),
            (
                format!(r#"{rl},"retry_after":"none"}}"#),
                Gemini,
                "mode",
                429,
                None,
            ),
            (format!("{rl}}}"), Azure, "mode", 429, Some(1250)),
            (format!("{rl}}}"), Anthropic, "mode", 429, Some(2000)),
            (format!("{rl}}}"), Gemini, "mode", 429, Some(2000)),
            (r#"{"mode":"quota"}"#.into(), OpenAi, "mode", 429, None),
            (r#"{"mode":"quota"}"#.into(), Anthropic, "mode", 429, None),
            (
                r#"{"mode":"overloaded"}"#.into(),
                Anthropic,
                "mode",
                529,
                Some(1000),
            ),
            (
                r#"{"mode":"error","status":500}"#.into(),
                OpenAi,
                "mode",
                500,
                None,
            ),
            (
                format!(r#"{rl},"keys":["other"]}}"#),
                OpenAi,
                "ok",
                200,
                None,
            ),
        ];
        for (sc, dialect, decision, status, hint) in rows {
            let mut st = State::new(scenario(&sc));
            let mut i = info("k");
            i.dialect = dialect;
            st.decide(&i, Instant::now(), sys);
            assert_eq!(
                last(&st),
                (decision.to_string(), status, hint),
                "{sc} {dialect:?}"
            );
        }
        // A non-POST is logged as such, whatever the scenario.
        let mut st = State::new(scenario(&format!("{rl}}}")));
        let mut i = info("k");
        i.method = "GET";
        i.forced_status = Some(405);
        let d = st.decide(&i, Instant::now(), sys);
        assert_eq!(last(&st), ("method_not_allowed".into(), 405, None));
        assert!(!d.in_flight);
    }
}
