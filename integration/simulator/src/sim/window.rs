//! The scenario's `limit`: a sliding window per account key, in which every targeted request
//! counts, rejected ones too.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::scenario::Limit;

/// What the window saw of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowCount {
    /// Requests of the key in the window, this one included.
    pub count: u64,
    /// Over the limit: ms until a request would be admitted.
    pub admit_ms: Option<u64>,
    /// Ms until the oldest entry leaves the window.
    pub oldest_ms: u64,
}

/// Each key's arrivals still in its window, oldest first.
#[derive(Default)]
pub struct Windows(HashMap<String, VecDeque<Instant>>);

fn ceil_ms(d: Duration) -> u64 {
    let nanos = d.as_nanos();
    nanos.div_ceil(1_000_000).min(u64::MAX as u128) as u64
}

impl Windows {
    /// Counts a request of `key` arriving at `now`.
    pub fn count(&mut self, key: &str, limit: &Limit, now: Instant) -> WindowCount {
        let w = Duration::from_millis(limit.window_ms);
        let q = self.0.entry(key.to_string()).or_default();
        while q.front().is_some_and(|&t| t + w <= now) {
            q.pop_front();
        }
        q.push_back(now);
        let n = q.len() as u64;
        let admit_ms = if n > limit.requests {
            // The next request is admitted once only limit-1 of the current entries remain,
            // i.e. when entry [n - limit] (0-based, oldest first) leaves the window.
            let idx = (n - limit.requests) as usize;
            q.get(idx)
                .map(|&t| ceil_ms((t + w).saturating_duration_since(now)).max(1))
        } else {
            None
        };
        let oldest_ms = q
            .front()
            .map(|&t| ceil_ms((t + w).saturating_duration_since(now)))
            .unwrap_or(limit.window_ms);
        WindowCount {
            count: n,
            admit_ms,
            oldest_ms,
        }
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, SystemTime};

    use crate::decision::Outcome;
    use crate::sim::testing::{info, scenario};
    use crate::sim::State;

    #[test]
    fn sliding_window_counts_rejected_requests() {
        let mut st = State::new(scenario(r#"{"limit":{"requests":2,"window_ms":1000}}"#));
        let t0 = Instant::now();
        let sys = SystemTime::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let a = st.decide(&info("k"), at(0), sys);
        assert_eq!(a.status, 200);
        assert_eq!(a.limits.remaining_requests, 1);
        let b = st.decide(&info("k"), at(100), sys);
        assert_eq!(b.status, 200);
        assert_eq!(b.limits.remaining_requests, 0);
        // Third is over: admitted again once only one of the three entries remains, i.e. when
        // the one at 100 ms expires (1100 ms), since the rejected one at 200 ms counts too.
        let c = st.decide(&info("k"), at(200), sys);
        assert_eq!(c.status, 429);
        assert_eq!(c.outcome, Outcome::RateLimited);
        assert_eq!(c.hint_ms, 900);
        assert_eq!(c.limits.remaining_requests, 0);
        assert_eq!(c.limits.reset_requests_ms, 900);
        // At 1050 ms the entry at 0 expired, but 100 and 200 (rejected) remain: still over.
        let d = st.decide(&info("k"), at(1050), sys);
        assert_eq!(d.status, 429, "rejected requests must count in the window");
        // Other keys have their own window.
        assert_eq!(st.decide(&info("other"), at(1050), sys).status, 200);
        // At 2300 ms every earlier entry has left the window.
        let e = st.decide(&info("k"), at(2300), sys);
        assert_eq!(e.status, 200);
        let doc = st.requests_json();
        assert_eq!(doc["total"], 6);
        assert_eq!(doc["by_status"]["429"], 2);
        assert_eq!(doc["by_key"]["k"]["200"], 3);
        assert_eq!(doc["requests"][2]["status"], 429);
        // The log says what was decided, the window count seen and the hint as sent
        // (default style: `retry-after` in whole seconds, 900 ms -> 1 s).
        let log = &doc["requests"];
        let fields = |i: usize| {
            (
                log[i]["decision"].as_str().unwrap(),
                log[i]["window_count"].as_u64(),
                log[i]["hint_ms"].as_u64(),
            )
        };
        assert_eq!(fields(0), ("ok", Some(1), None));
        assert_eq!(fields(1), ("ok", Some(2), None));
        assert_eq!(fields(2), ("window_full", Some(3), Some(1000)));
        assert_eq!(fields(3), ("window_full", Some(3), Some(1000)));
        assert_eq!(fields(4), ("ok", Some(1), None));
        assert_eq!(fields(5), ("ok", Some(1), None));
    }

    #[test]
    fn an_outage_counts_in_the_window_and_its_answers_tell_its_true_rest() {
        let mut st = State::new(scenario(
            r#"{"mode":"rate_limited","retry_after_s":1,"down_until_ms":2500,
                "limit":{"requests":3,"window_ms":2000}}"#,
        ));
        let t0 = Instant::now();
        let sys = SystemTime::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // In the outage: a 429 saying retry-after 1 s, its reset the rest of the outage.
        let a = st.decide(&info("k"), at(1000), sys);
        assert_eq!((a.status, a.hint_ms), (429, 1000));
        assert_eq!(a.limits.remaining_requests, 0);
        assert_eq!(a.limits.reset_requests_ms, 1500);
        let b = st.decide(&info("k"), at(2000), sys);
        assert_eq!(b.limits.reset_requests_ms, 500);
        // After it, the window decides, with the outage's requests in it: 1 s and 2 s are
        // still there at 2.6 s, so one more fits; the next is over until only two of the four
        // remain (when the one at 2 s leaves, at 4 s).
        assert_eq!(st.decide(&info("k"), at(2600), sys).status, 200);
        let d = st.decide(&info("k"), at(2700), sys);
        assert_eq!(d.status, 429);
        assert_eq!(
            d.hint_ms, 1300,
            "after the outage the window's own time, not retry_after_s"
        );
        assert_eq!(d.limits.reset_requests_ms, 1300);
    }
}
