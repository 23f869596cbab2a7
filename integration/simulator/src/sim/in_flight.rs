//! Requests being answered now, per key and in all, and the most seen at once: what the
//! scenario's `max_concurrency` limits.

use std::collections::{BTreeMap, HashMap};

/// The retry hint of a 429 for `max_concurrency`: a slot frees as soon as any request ends.
pub const CONCURRENCY_HINT_MS: u64 = 1000;

/// Requests being processed now and the most seen at once.
#[derive(Default)]
pub struct InFlight {
    now: u64,
    by_key: HashMap<String, u64>,
    max: u64,
    max_by_key: BTreeMap<String, u64>,
}

impl InFlight {
    /// Requests in flight, all keys.
    pub fn now(&self) -> u64 {
        self.now
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    pub fn max_by_key(&self) -> &BTreeMap<String, u64> {
        &self.max_by_key
    }

    /// Requests of `key` in flight.
    pub fn of(&self, key: &str) -> u64 {
        self.by_key.get(key).copied().unwrap_or(0)
    }

    pub fn start(&mut self, key: &str) {
        self.now += 1;
        let n = self.by_key.entry(key.to_string()).or_default();
        *n += 1;
        let n = *n;
        self.max = self.max.max(self.now);
        let max = self.max_by_key.entry(key.to_string()).or_default();
        *max = (*max).max(n);
    }

    pub fn finish(&mut self, key: &str) {
        self.now = self.now.saturating_sub(1);
        if let Some(n) = self.by_key.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.by_key.remove(key);
            }
        }
    }

    /// Forgets the maxima; requests still in flight stay counted (they finish later).
    pub fn reset_max(&mut self) {
        self.max = self.now;
        self.max_by_key = self.by_key.iter().map(|(k, &n)| (k.clone(), n)).collect();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Instant, SystemTime};

    use serde_json::{json, Value};

    use super::CONCURRENCY_HINT_MS;
    use crate::decision::{Outcome, Reason};
    use crate::dialect::Dialect;
    use crate::sim::testing::{info, last, scenario};
    use crate::sim::State;

    #[test]
    fn concurrency_limit_counts_requests_in_flight_per_key() {
        let mut st = State::new(scenario(r#"{"max_concurrency":2}"#));
        let now = Instant::now();
        let sys = SystemTime::now();
        let a = st.decide(&info("k"), now, sys);
        let b = st.decide(&info("k"), now, sys);
        let o = st.decide(&info("other"), now, sys);
        assert!(a.in_flight && b.in_flight && o.in_flight);
        assert_eq!((a.status, b.status, o.status), (200, 200, 200));
        // Third of "k" while two are in flight: a 429 with a 1 s hint, not counted in flight,
        // and no rate-limit dimension reported exhausted.
        let c = st.decide(&info("k"), now, sys);
        assert_eq!(c.status, 429);
        assert_eq!(c.reason, Reason::Concurrency);
        assert_eq!(c.outcome, Outcome::RateLimited);
        assert_eq!(c.hint_ms, CONCURRENCY_HINT_MS);
        assert_eq!(c.exhausted, None);
        assert_eq!(c.limits.remaining_requests, 59);
        assert!(!c.in_flight);
        let doc = st.requests_json();
        assert_eq!(doc["in_flight"], 3);
        assert_eq!(doc["max_in_flight"], 3);
        assert_eq!(doc["max_in_flight_by_key"], json!({"k": 2, "other": 1}));
        let arrival = |i: usize| {
            let e = &doc["requests"][i];
            (e["in_flight"].as_u64(), e["in_flight_key"].as_u64())
        };
        assert_eq!(arrival(0), (Some(0), Some(0)));
        assert_eq!(arrival(1), (Some(1), Some(1)));
        assert_eq!(arrival(2), (Some(2), Some(0)));
        assert_eq!(arrival(3), (Some(3), Some(2)));
        assert_eq!(doc["requests"][3]["decision"], "concurrency");
        assert_eq!(doc["requests"][3]["hint_ms"], 1000);
        assert_eq!(doc["requests"][3]["window_count"], Value::Null);

        // Other dialects answer with their own rate-limit shape.
        let mut i = info("k");
        i.dialect = Dialect::Anthropic;
        assert_eq!(st.decide(&i, now, sys).status, 429);
        i.dialect = Dialect::Gemini;
        assert_eq!(st.decide(&i, now, sys).outcome, Outcome::GeminiMinute);
        assert_eq!(last(&st), ("concurrency".into(), 429, Some(1000)));

        // One of "k" ends: the next is admitted; the maxima stay.
        st.finish("k");
        assert_eq!(st.decide(&info("k"), now, sys).status, 200);
        assert_eq!(st.decide(&info("k"), now, sys).status, 429);
        let doc = st.requests_json();
        assert_eq!(doc["in_flight"], 3);
        assert_eq!(doc["max_in_flight"], 3);

        // With `retry_after: none` the 429 carries no hint at all (no dimension is exhausted).
        st.set_scenario(scenario(r#"{"max_concurrency":1,"retry_after":"none"}"#));
        assert_eq!(st.decide(&info("k"), now, sys).reason, Reason::Concurrency);
        assert_eq!(last(&st), ("concurrency".into(), 429, None));

        // Reset forgets the maxima but not what is still in flight.
        st.finish("k");
        st.finish("other");
        st.reset();
        let doc = st.requests_json();
        assert_eq!(doc["in_flight"], 1);
        assert_eq!(doc["max_in_flight"], 1);
        assert_eq!(doc["max_in_flight_by_key"], json!({"k": 1}));
        st.finish("k");
        assert_eq!(st.requests_json()["in_flight"], 0);
    }

    #[test]
    fn concurrency_limit_follows_targeting_and_precedence() {
        let now = Instant::now();
        let sys = SystemTime::now();
        // Only the listed keys are limited.
        let mut st = State::new(scenario(r#"{"max_concurrency":1,"keys":["a"]}"#));
        for _ in 0..3 {
            assert_eq!(st.decide(&info("b"), now, sys).status, 200);
        }
        assert_eq!(st.decide(&info("a"), now, sys).status, 200);
        assert_eq!(st.decide(&info("a"), now, sys).reason, Reason::Concurrency);

        // Each concurrency rejection uses one unit of `count`.
        st.set_scenario(scenario(r#"{"max_concurrency":1,"count":1}"#));
        st.decide(&info("c"), now, sys);
        assert_eq!(st.decide(&info("c"), now, sys).reason, Reason::Concurrency);
        assert_eq!(st.decide(&info("c"), now, sys).reason, Reason::Ok);

        // A full window wins over concurrency (its hint says when), and the rejected request
        // still counts in the window.
        st.set_scenario(scenario(
            r#"{"max_concurrency":1,"limit":{"requests":1,"window_ms":60000}}"#,
        ));
        assert_eq!(st.decide(&info("d"), now, sys).reason, Reason::Ok);
        let w = st.decide(&info("d"), now, sys);
        assert_eq!(w.reason, Reason::WindowFull);
        assert!(!w.in_flight, "window rejections are not in flight");
        assert!(w.hint_ms > CONCURRENCY_HINT_MS);

        // The mode answers before concurrency is looked at; mode answers are not in flight.
        st.set_scenario(scenario(r#"{"mode":"quota","max_concurrency":1}"#));
        let q = st.decide(&info("e"), now, sys);
        assert_eq!((q.reason, q.in_flight), (Reason::Mode, false));
        assert_eq!(st.decide(&info("e"), now, sys).reason, Reason::Mode);
        assert_eq!(st.requests_json()["max_in_flight_by_key"]["e"], Value::Null);
    }
}
