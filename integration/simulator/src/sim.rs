//! Global simulator state: the scenario, its clock, per-key sliding windows and the request log.
//! Lives behind one Mutex; every provider request takes the lock once to decide and log.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::scenario::{Dimension, Mode, RetryStyle, Scenario};
use crate::timefmt::unix_ms;

/// Most request-log entries kept (counters keep counting past it; `dropped` says how many).
pub const MAX_LOG: usize = 200_000;
/// Completion tokens reported when the scenario does not say.
pub const DEFAULT_OUTPUT_TOKENS: u64 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Azure,
    Anthropic,
    Gemini,
}

impl Dialect {
    pub fn name(self) -> &'static str {
        match self {
            Dialect::OpenAi => "openai",
            Dialect::Azure => "azure_openai",
            Dialect::Anthropic => "anthropic",
            Dialect::Gemini => "gemini",
        }
    }
}

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

/// Rate-limit values reported in headers, fully resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    pub latency_ms: u64,
    pub stream_delay_ms: u64,
    pub now_unix_ms: u64,
}

pub struct ReqInfo<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub key: &'a str,
    pub dialect: Dialect,
    pub est_input_tokens: u64,
    /// Non-POST requests to provider paths are logged but always answered 405.
    pub forced_status: Option<u16>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LogEntry {
    pub t_ms: f64,
    pub unix_ms: u64,
    pub method: String,
    pub path: String,
    pub key: String,
    pub dialect: &'static str,
    pub status: u16,
}

pub struct State {
    scenario: Scenario,
    started: Instant,
    remaining_count: Option<u64>,
    windows: HashMap<String, VecDeque<Instant>>,
    log: VecDeque<LogEntry>,
    dropped: u64,
    total: u64,
    by_status: BTreeMap<u16, u64>,
    by_key: BTreeMap<String, BTreeMap<u16, u64>>,
}

fn ms_between(later: Instant, earlier: Instant) -> f64 {
    later.saturating_duration_since(earlier).as_secs_f64() * 1000.0
}

fn ceil_ms(d: Duration) -> u64 {
    let nanos = d.as_nanos();
    nanos.div_ceil(1_000_000).min(u64::MAX as u128) as u64
}

impl State {
    pub fn new(scenario: Scenario) -> Self {
        let mut s = State {
            scenario: Scenario::default(),
            started: Instant::now(),
            remaining_count: None,
            windows: HashMap::new(),
            log: VecDeque::new(),
            dropped: 0,
            total: 0,
            by_status: BTreeMap::new(),
            by_key: BTreeMap::new(),
        };
        s.set_scenario(scenario);
        s
    }

    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// Replaces the scenario, restarts the scenario clock and forgets windows and `count`.
    /// The request log is kept.
    pub fn set_scenario(&mut self, scenario: Scenario) {
        self.remaining_count = scenario.count;
        self.scenario = scenario;
        self.started = Instant::now();
        self.windows.clear();
    }

    /// Back to the default scenario with an empty log.
    pub fn reset(&mut self) {
        self.set_scenario(Scenario::default());
        self.log.clear();
        self.dropped = 0;
        self.total = 0;
        self.by_status.clear();
        self.by_key.clear();
    }

    /// Decides the answer to one provider request and logs it.
    pub fn decide(&mut self, req: &ReqInfo, now: Instant, now_sys: SystemTime) -> Decision {
        let sc = &self.scenario;
        let t_ms = ms_between(now, self.started);
        let targeted = sc
            .keys
            .as_ref()
            .map_or(true, |keys| keys.iter().any(|k| k == req.key))
            && sc.until_ms.map_or(true, |u| t_ms < u)
            && self.remaining_count != Some(0)
            && req.forced_status.is_none();

        // Sliding window: every targeted request is counted, rejected ones too.
        // (count in window after this request, ms until admission if over, ms until oldest expires)
        let mut window: Option<(u64, Option<u64>, u64)> = None;
        if let (true, Some(limit)) = (targeted, sc.limit.as_ref()) {
            let w = Duration::from_millis(limit.window_ms);
            let q = self.windows.entry(req.key.to_string()).or_default();
            while q.front().is_some_and(|&t| t + w <= now) {
                q.pop_front();
            }
            q.push_back(now);
            let n = q.len() as u64;
            let admit = if n > limit.requests {
                // The next request is admitted once only limit-1 of the current entries remain,
                // i.e. when entry [n - limit] (0-based, oldest first) leaves the window.
                let idx = (n - limit.requests) as usize;
                q.get(idx)
                    .map(|&t| ceil_ms((t + w).saturating_duration_since(now)).max(1))
            } else {
                None
            };
            let oldest = q
                .front()
                .map(|&t| ceil_ms((t + w).saturating_duration_since(now)))
                .unwrap_or(limit.window_ms);
            window = Some((n, admit, oldest));
        }

        let reject = targeted
            && match (&sc.limit, window) {
                (Some(_), Some((_, admit, _))) => admit.is_some(),
                _ => sc.mode != Mode::Ok,
            };
        let mut outcome = if !reject {
            Outcome::Ok
        } else {
            match sc.mode {
                Mode::Ok | Mode::RateLimited => Outcome::RateLimited,
                Mode::Quota => Outcome::Quota,
                Mode::Overloaded => Outcome::Overloaded,
                Mode::Unavailable => Outcome::Unavailable,
                Mode::GeminiMinute => Outcome::GeminiMinute,
                Mode::GeminiDay => Outcome::GeminiDay,
                Mode::Error => Outcome::Error(sc.error_status()),
            }
        };
        if req.dialect == Dialect::Gemini {
            outcome = match outcome {
                Outcome::RateLimited => Outcome::GeminiMinute,
                Outcome::Quota => Outcome::GeminiDay,
                o => o,
            };
        }
        if reject {
            if let Some(c) = self.remaining_count.as_mut() {
                *c = c.saturating_sub(1);
            }
        }

        let hint_ms = sc
            .retry_after_s
            .map(|s| (s * 1000.0).ceil() as u64)
            .or(window.and_then(|(_, admit, _)| admit))
            .unwrap_or(1000);

        let usage = sc.usage.clone().unwrap_or_default();
        let input_tokens = usage.input_tokens.unwrap_or(req.est_input_tokens);
        let output_tokens = usage.output_tokens.unwrap_or(DEFAULT_OUTPUT_TOKENS);

        let rl = sc.ratelimit.clone().unwrap_or_default();
        let limit_requests = rl
            .limit_requests
            .or(sc.limit.as_ref().map(|l| l.requests))
            .unwrap_or(60);
        let remaining_requests = rl
            .remaining_requests
            .or(sc
                .limit
                .as_ref()
                .zip(window)
                .map(|(l, (n, _, _))| l.requests.saturating_sub(n)))
            .unwrap_or(limit_requests.saturating_sub(1));
        let reset_requests_ms = rl
            .reset_requests_ms
            .or(window.map(|(_, _, oldest)| oldest))
            .unwrap_or(1000);
        let limit_tokens = rl.limit_tokens.unwrap_or(100_000);
        let reset_tokens_ms = rl.reset_tokens_ms.unwrap_or(6000);
        let limit_input_tokens = rl.limit_input_tokens.unwrap_or(80_000);
        let limit_output_tokens = rl.limit_output_tokens.unwrap_or(20_000);
        let mut limits = Limits {
            limit_requests,
            remaining_requests,
            reset_requests_ms,
            limit_tokens,
            remaining_tokens: rl
                .remaining_tokens
                .unwrap_or(limit_tokens.saturating_sub(input_tokens + output_tokens)),
            reset_tokens_ms,
            limit_input_tokens,
            remaining_input_tokens: rl
                .remaining_input_tokens
                .unwrap_or(limit_input_tokens.saturating_sub(input_tokens)),
            reset_input_tokens_ms: reset_tokens_ms,
            limit_output_tokens,
            remaining_output_tokens: rl
                .remaining_output_tokens
                .unwrap_or(limit_output_tokens.saturating_sub(output_tokens)),
            reset_output_tokens_ms: reset_tokens_ms,
        };

        let exhausted = match outcome {
            Outcome::RateLimited | Outcome::GeminiMinute => Some(sc.dimension.unwrap_or_default()),
            _ => None,
        };
        match exhausted {
            Some(Dimension::Requests) => {
                limits.remaining_requests = 0;
                limits.reset_requests_ms = hint_ms;
            }
            Some(Dimension::Tokens) => {
                limits.remaining_tokens = 0;
                limits.reset_tokens_ms = hint_ms;
            }
            Some(Dimension::InputTokens) => {
                limits.remaining_input_tokens = 0;
                limits.reset_input_tokens_ms = hint_ms;
            }
            Some(Dimension::OutputTokens) => {
                limits.remaining_output_tokens = 0;
                limits.reset_output_tokens_ms = hint_ms;
            }
            None => {}
        }

        let status = req
            .forced_status
            .unwrap_or_else(|| outcome.status(req.dialect));
        let now_unix_ms = unix_ms(now_sys);
        let decision = Decision {
            outcome,
            status,
            hint_ms,
            style: sc.retry_after,
            exhausted,
            limits,
            input_tokens,
            output_tokens,
            latency_ms: sc.latency_ms.unwrap_or(0),
            stream_delay_ms: sc.stream_delay_ms.unwrap_or(0),
            now_unix_ms,
        };
        self.record(LogEntry {
            t_ms: (t_ms * 1000.0).round() / 1000.0,
            unix_ms: now_unix_ms,
            method: req.method.to_string(),
            path: req.path.to_string(),
            key: req.key.to_string(),
            dialect: req.dialect.name(),
            status,
        });
        decision
    }

    fn record(&mut self, e: LogEntry) {
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

    /// The `GET /_sim/requests` document.
    pub fn requests_json(&self) -> Value {
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
            "t_ms": ms_between(Instant::now(), self.started).round(),
            "by_status": status_map(&self.by_status),
            "by_key": by_key,
            "requests": self.log,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(key: &str) -> ReqInfo<'_> {
        ReqInfo {
            method: "POST",
            path: "/v1/chat/completions",
            key,
            dialect: Dialect::OpenAi,
            est_input_tokens: 10,
            forced_status: None,
        }
    }

    fn scenario(j: &str) -> Scenario {
        Scenario::parse(j.as_bytes()).unwrap()
    }

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
    }

    #[test]
    fn count_keys_and_until() {
        let mut st = State::new(scenario(
            r#"{"mode":"rate_limited","count":2,"keys":["a"]}"#,
        ));
        let now = Instant::now();
        let sys = SystemTime::now();
        assert_eq!(st.decide(&info("b"), now, sys).status, 200);
        assert_eq!(st.decide(&info("a"), now, sys).status, 429);
        assert_eq!(st.decide(&info("a"), now, sys).status, 429);
        assert_eq!(st.decide(&info("a"), now, sys).status, 200);

        st.set_scenario(scenario(r#"{"mode":"overloaded","until_ms":500}"#));
        let t0 = Instant::now();
        let mut i = info("a");
        i.dialect = Dialect::Anthropic;
        assert_eq!(st.decide(&i, t0, sys).status, 529);
        assert_eq!(st.decide(&info("a"), t0, sys).status, 503);
        assert_eq!(
            st.decide(&i, t0 + Duration::from_millis(600), sys).status,
            200
        );
    }

    #[test]
    fn dimension_and_overrides() {
        let mut st = State::new(scenario(
            r#"{"mode":"rate_limited","dimension":"tokens","retry_after_s":2.5,
                "ratelimit":{"limit_tokens":30000,"remaining_requests":7}}"#,
        ));
        let d = st.decide(&info("a"), Instant::now(), SystemTime::now());
        assert_eq!(d.hint_ms, 2500);
        assert_eq!(d.exhausted, Some(Dimension::Tokens));
        assert_eq!(d.limits.remaining_tokens, 0);
        assert_eq!(d.limits.reset_tokens_ms, 2500);
        assert_eq!(d.limits.remaining_requests, 7);
        assert_eq!(d.limits.limit_tokens, 30000);

        st.set_scenario(scenario(r#"{"mode":"quota"}"#));
        let mut g = info("a");
        g.dialect = Dialect::Gemini;
        assert_eq!(
            st.decide(&g, Instant::now(), SystemTime::now()).outcome,
            Outcome::GeminiDay
        );
        st.reset();
        assert_eq!(st.requests_json()["total"], 0);
        assert_eq!(st.scenario().mode, Mode::Ok);
    }
}
