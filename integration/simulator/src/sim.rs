//! Global simulator state: the scenario, its clock, per-key sliding windows and token buckets,
//! requests in flight and the request log. Lives behind one Mutex; every provider request takes the lock once to
//! decide and log, and once more (`State::finish`) when its answer is written.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::providers;
use crate::scenario::{Dimension, Mode, RetryStyle, Scenario};
use crate::timefmt::unix_ms;
use crate::tpm;

/// Most request-log entries kept (counters keep counting past it; `dropped` says how many).
pub const MAX_LOG: usize = 200_000;
/// Completion tokens reported when the scenario does not say (less if the request's output
/// limit is lower).
pub const DEFAULT_OUTPUT_TOKENS: u64 = 5;
/// The retry hint of a 429 for `max_concurrency`: a slot frees as soon as any request ends.
pub const CONCURRENCY_HINT_MS: u64 = 1000;

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
        )
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

pub struct ReqInfo<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub key: &'a str,
    pub dialect: Dialect,
    pub est_input_tokens: u64,
    /// The output limit from the body (`providers::output_limit`), if it has a valid one.
    pub max_output_tokens: Option<u64>,
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
    /// Requests in flight when this one arrived, not counting itself: all keys, and this key.
    pub in_flight: u64,
    pub in_flight_key: u64,
}

/// Requests being processed now and the most seen at once.
#[derive(Default)]
struct InFlight {
    now: u64,
    by_key: HashMap<String, u64>,
    max: u64,
    max_by_key: BTreeMap<String, u64>,
}

impl InFlight {
    fn of(&self, key: &str) -> u64 {
        self.by_key.get(key).copied().unwrap_or(0)
    }

    fn start(&mut self, key: &str) {
        self.now += 1;
        let n = self.by_key.entry(key.to_string()).or_default();
        *n += 1;
        let n = *n;
        self.max = self.max.max(self.now);
        let max = self.max_by_key.entry(key.to_string()).or_default();
        *max = (*max).max(n);
    }

    fn finish(&mut self, key: &str) {
        self.now = self.now.saturating_sub(1);
        if let Some(n) = self.by_key.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.by_key.remove(key);
            }
        }
    }

    /// Forgets the maxima; requests still in flight stay counted (they finish later).
    fn reset_max(&mut self) {
        self.max = self.now;
        self.max_by_key = self.by_key.iter().map(|(k, &n)| (k.clone(), n)).collect();
    }
}

pub struct State {
    scenario: Scenario,
    started: Instant,
    remaining_count: Option<u64>,
    windows: HashMap<String, VecDeque<Instant>>,
    buckets: HashMap<String, tpm::Bucket>,
    log: VecDeque<LogEntry>,
    dropped: u64,
    total: u64,
    by_status: BTreeMap<u16, u64>,
    by_key: BTreeMap<String, BTreeMap<u16, u64>>,
    in_flight: InFlight,
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
            buckets: HashMap::new(),
            log: VecDeque::new(),
            dropped: 0,
            total: 0,
            by_status: BTreeMap::new(),
            by_key: BTreeMap::new(),
            in_flight: InFlight::default(),
        };
        s.set_scenario(scenario);
        s
    }

    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// Replaces the scenario, restarts the scenario clock and forgets windows, token buckets
    /// and `count`.
    /// The request log is kept.
    pub fn set_scenario(&mut self, scenario: Scenario) {
        self.remaining_count = scenario.count;
        self.scenario = scenario;
        self.started = Instant::now();
        self.windows.clear();
        self.buckets.clear();
    }

    /// Back to the default scenario with an empty log and forgotten in-flight maxima.
    pub fn reset(&mut self) {
        self.in_flight.reset_max();
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

        let usage = sc.usage.clone().unwrap_or_default();
        let input_tokens = usage.input_tokens.unwrap_or(req.est_input_tokens);
        let output_tokens = usage.output_tokens.unwrap_or(
            req.max_output_tokens
                .map_or(DEFAULT_OUTPUT_TOKENS, |m| m.min(DEFAULT_OUTPUT_TOKENS)),
        );

        // Token bucket: a targeted request's count is looked at here and charged below, only
        // if it is served.
        let tpm = sc.tpm.as_ref().filter(|_| targeted).map(|t| {
            let counted = req
                .est_input_tokens
                .saturating_add(req.max_output_tokens.unwrap_or(output_tokens));
            let bucket = self
                .buckets
                .entry(req.key.to_string())
                .or_insert_with(|| tpm::Bucket::full(t.tokens, now));
            let used = bucket.level(t.tokens, now).used;
            (
                t.tokens,
                counted,
                used,
                bucket.check(t.tokens, now, counted),
            )
        });

        let in_flight = self.in_flight.now;
        let in_flight_key = self.in_flight.of(req.key);
        // Tokens and concurrency only reject what would otherwise succeed.
        let reason = if req.forced_status.is_some() {
            Reason::MethodNotAllowed
        } else if !targeted {
            Reason::Ok
        } else if window.is_some_and(|(_, admit, _)| admit.is_some()) {
            Reason::WindowFull
        } else if sc.limit.is_none() && sc.mode != Mode::Ok {
            Reason::Mode
        } else if let Some((.., tpm::Take::Wait { .. })) = tpm {
            Reason::TokensExhausted
        } else if let Some((.., tpm::Take::TooLarge)) = tpm {
            Reason::TokensTooLarge
        } else if sc.max_concurrency.is_some_and(|max| in_flight_key >= max) {
            Reason::Concurrency
        } else {
            Reason::Ok
        };
        let mut outcome = match reason {
            Reason::Ok | Reason::MethodNotAllowed => Outcome::Ok,
            Reason::Concurrency | Reason::TokensExhausted | Reason::TokensTooLarge => {
                Outcome::RateLimited
            }
            Reason::WindowFull | Reason::Mode => match sc.mode {
                Mode::Ok | Mode::RateLimited => Outcome::RateLimited,
                Mode::Quota => Outcome::Quota,
                Mode::Overloaded => Outcome::Overloaded,
                Mode::Unavailable => Outcome::Unavailable,
                Mode::GeminiMinute => Outcome::GeminiMinute,
                Mode::GeminiDay => Outcome::GeminiDay,
                Mode::Error => Outcome::Error(sc.error_status()),
            },
        };
        if req.dialect == Dialect::Gemini {
            outcome = match outcome {
                Outcome::RateLimited => Outcome::GeminiMinute,
                Outcome::Quota => Outcome::GeminiDay,
                o => o,
            };
        }
        if reason.is_rejection() {
            if let Some(c) = self.remaining_count.as_mut() {
                *c = c.saturating_sub(1);
            }
        }

        // The bucket as the answer reports it: after the charge of a served request.
        let bucket = tpm.and_then(|(capacity, counted, _, _)| {
            let b = self.buckets.get_mut(req.key)?;
            if reason == Reason::Ok {
                b.charge(capacity, now, counted);
            }
            Some(b.level(capacity, now))
        });
        let token_wait = match (reason, tpm) {
            (Reason::TokensExhausted, Some((.., tpm::Take::Wait { wait_ms }))) => Some(wait_ms),
            // Never fits: the time until the bucket is full is all there is to say.
            (Reason::TokensTooLarge, _) => bucket.map(|b| b.reset_ms.max(1)),
            _ => None,
        };

        let hint_ms = if reason == Reason::Concurrency {
            CONCURRENCY_HINT_MS
        } else {
            sc.retry_after_s
                .map(|s| (s * 1000.0).ceil() as u64)
                .or(window.and_then(|(_, admit, _)| admit))
                .or(token_wait)
                .unwrap_or(1000)
        };

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
        let limit_tokens = rl
            .limit_tokens
            .or(sc.tpm.as_ref().map(|t| t.tokens))
            .unwrap_or(100_000);
        let reset_tokens_ms = rl
            .reset_tokens_ms
            .or(bucket.map(|b| b.reset_ms))
            .unwrap_or(6000);
        let limit_input_tokens = rl.limit_input_tokens.unwrap_or(80_000);
        let limit_output_tokens = rl.limit_output_tokens.unwrap_or(20_000);
        let mut limits = Limits {
            limit_requests,
            remaining_requests,
            reset_requests_ms,
            limit_tokens,
            remaining_tokens: rl
                .remaining_tokens
                .or(bucket.map(|b| b.remaining))
                .unwrap_or(limit_tokens.saturating_sub(input_tokens.saturating_add(output_tokens))),
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

        // A concurrency 429 exhausts no rate-limit dimension: the headers stay as they are. A
        // token 429 reports the tokens dimension with the bucket's own values.
        let exhausted = match outcome {
            _ if reason == Reason::Concurrency => None,
            _ if matches!(reason, Reason::TokensExhausted | Reason::TokensTooLarge) => {
                Some(Dimension::Tokens)
            }
            Outcome::RateLimited | Outcome::GeminiMinute => Some(sc.dimension.unwrap_or_default()),
            _ => None,
        };
        match exhausted {
            Some(Dimension::Tokens)
                if matches!(reason, Reason::TokensExhausted | Reason::TokensTooLarge) => {}
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
            reason,
            outcome,
            status,
            hint_ms,
            style: sc.retry_after,
            exhausted,
            limits,
            input_tokens,
            output_tokens,
            tokens: tpm.map(|(limit, counted, used, _)| TokenUse {
                limit,
                counted,
                used,
            }),
            latency_ms: sc.latency_ms.unwrap_or(0),
            stream_delay_ms: sc.stream_delay_ms.unwrap_or(0),
            now_unix_ms,
            in_flight: reason == Reason::Ok,
        };
        if decision.in_flight {
            self.in_flight.start(req.key);
        }
        self.record(LogEntry {
            t_ms: (t_ms * 1000.0).round() / 1000.0,
            unix_ms: now_unix_ms,
            method: req.method.to_string(),
            path: req.path.to_string(),
            key: req.key.to_string(),
            dialect: req.dialect.name(),
            status,
            decision: reason,
            hint_ms: providers::sent_hint_ms(req.dialect, &decision),
            window_count: window.map(|(n, _, _)| n),
            counted_tokens: tpm.map(|(_, counted, _, _)| counted),
            tokens_remaining: bucket.map(|b| b.remaining),
            in_flight,
            in_flight_key,
        });
        decision
    }

    /// A request counted in flight (`Decision::in_flight`) has been answered.
    pub fn finish(&mut self, key: &str) {
        self.in_flight.finish(key);
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
            "in_flight": self.in_flight.now,
            "max_in_flight": self.in_flight.max,
            "max_in_flight_by_key": self.in_flight.max_by_key,
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
            max_output_tokens: None,
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

    /// The last log entry as (decision, status, hint_ms).
    fn last(st: &State) -> (String, u64, Option<u64>) {
        let doc = st.requests_json();
        let e = doc["requests"].as_array().unwrap().last().unwrap().clone();
        (
            e["decision"].as_str().unwrap().to_string(),
            e["status"].as_u64().unwrap(),
            e["hint_ms"].as_u64(),
        )
    }

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

    /// A request counted 1,000 tokens: 10 estimated input + `max_tokens` 990.
    fn thousand(key: &str) -> ReqInfo<'_> {
        let mut i = info(key);
        i.max_output_tokens = Some(990);
        i
    }

    /// The last log entry as (decision, status, hint_ms, counted_tokens, tokens_remaining).
    fn last_tokens(st: &State) -> (String, u64, Option<u64>, Option<u64>, Option<u64>) {
        let doc = st.requests_json();
        let e = doc["requests"].as_array().unwrap().last().unwrap().clone();
        (
            e["decision"].as_str().unwrap().to_string(),
            e["status"].as_u64().unwrap(),
            e["hint_ms"].as_u64(),
            e["counted_tokens"].as_u64(),
            e["tokens_remaining"].as_u64(),
        )
    }

    #[test]
    fn tpm_admits_what_fits_and_does_not_charge_rejections() {
        let mut st = State::new(scenario(r#"{"tpm":{"tokens":20000}}"#));
        let t0 = Instant::now();
        let sys = SystemTime::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        for n in 1..=20u64 {
            let d = st.decide(&thousand("k"), t0, sys);
            assert_eq!((d.status, d.reason), (200, Reason::Ok), "request {n}");
            assert_eq!(d.limits.limit_tokens, 20000);
            assert_eq!(d.limits.remaining_tokens, 20000 - 1000 * n);
            // Until full again: the tokens in use at 1/3 token per ms.
            assert_eq!(d.limits.reset_tokens_ms, 3 * 1000 * n);
        }
        // The 21st does not fit: 1,000 more tokens take 3 s. It is not charged, so a second
        // one 1.5 s later waits 1.5 s, not 4.5 s.
        let d = st.decide(&thousand("k"), t0, sys);
        assert_eq!((d.status, d.reason), (429, Reason::TokensExhausted));
        assert_eq!(d.outcome, Outcome::RateLimited);
        assert_eq!(d.exhausted, Some(Dimension::Tokens));
        assert_eq!(d.hint_ms, 3000);
        assert!(!d.in_flight);
        assert_eq!(
            d.tokens,
            Some(TokenUse {
                limit: 20000,
                counted: 1000,
                used: 20000
            })
        );
        // The real bucket, not a zeroed dimension with the hint as its reset.
        assert_eq!(
            (d.limits.remaining_tokens, d.limits.reset_tokens_ms),
            (0, 60000)
        );
        assert_eq!(
            last_tokens(&st),
            (
                "tokens_exhausted".into(),
                429,
                Some(3000),
                Some(1000),
                Some(0)
            )
        );
        let d = st.decide(&thousand("k"), at(1500), sys);
        assert_eq!((d.reason, d.hint_ms), (Reason::TokensExhausted, 1500));
        assert_eq!(
            (d.limits.remaining_tokens, d.limits.reset_tokens_ms),
            (500, 58500)
        );
        // At 3 s it fits, and takes the bucket back to empty.
        let d = st.decide(&thousand("k"), at(3000), sys);
        assert_eq!(d.reason, Reason::Ok);
        assert_eq!(
            last_tokens(&st),
            ("ok".into(), 200, None, Some(1000), Some(0))
        );
        // Each key has its own bucket; a new scenario starts every bucket full.
        assert_eq!(
            st.decide(&thousand("other"), at(3000), sys).reason,
            Reason::Ok
        );
        st.set_scenario(scenario(r#"{"tpm":{"tokens":20000}}"#));
        let d = st.decide(&thousand("k"), Instant::now(), sys);
        assert_eq!((d.reason, d.limits.remaining_tokens), (Reason::Ok, 19000));
        // Without tpm nothing is counted.
        st.set_scenario(scenario("{}"));
        st.decide(&thousand("k"), Instant::now(), sys);
        assert_eq!(last_tokens(&st), ("ok".into(), 200, None, None, None));
    }

    #[test]
    fn tpm_counts_the_output_limit_or_the_completion() {
        let now = Instant::now();
        let sys = SystemTime::now();
        // (scenario, max_output_tokens, counted, completion reported)
        let rows: [(&str, Option<u64>, u64, u64); 5] = [
            // No output limit: the completion the simulator reports (5).
            (
                r#"{"tpm":{"tokens":20000}}"#,
                None,
                10 + DEFAULT_OUTPUT_TOKENS,
                5,
            ),
            // With one: all of it counts; the completion is at most the limit.
            (r#"{"tpm":{"tokens":20000}}"#, Some(200), 210, 5),
            (r#"{"tpm":{"tokens":20000}}"#, Some(3), 13, 3),
            (r#"{"tpm":{"tokens":20000}}"#, Some(0), 10, 0),
            // The scenario's usage sets the completion; the count still uses the limit.
            (
                r#"{"tpm":{"tokens":20000},"usage":{"input_tokens":7,"output_tokens":300}}"#,
                Some(200),
                210,
                300,
            ),
        ];
        for (sc, max, counted, completion) in rows {
            let mut st = State::new(scenario(sc));
            let mut i = info("k");
            i.max_output_tokens = max;
            let d = st.decide(&i, now, sys);
            assert_eq!(d.tokens.map(|t| t.counted), Some(counted), "{sc} {max:?}");
            assert_eq!(d.output_tokens, completion, "{sc} {max:?}");
            assert_eq!(d.limits.remaining_tokens, 20000 - counted, "{sc} {max:?}");
        }
        // The usage's prompt tokens do not change the count: the estimate is the provider's.
        let mut st = State::new(scenario(
            r#"{"tpm":{"tokens":100},"usage":{"input_tokens":7}}"#,
        ));
        let d = st.decide(&info("k"), now, sys);
        assert_eq!((d.input_tokens, d.tokens.map(|t| t.counted)), (7, Some(15)));
    }

    #[test]
    fn tpm_too_large_never_fits_and_is_not_charged() {
        let mut st = State::new(scenario(r#"{"tpm":{"tokens":20000}}"#));
        let now = Instant::now();
        let sys = SystemTime::now();
        for max in [19_991, u64::MAX] {
            let mut i = info("k");
            i.max_output_tokens = Some(max);
            let d = st.decide(&i, now, sys);
            assert_eq!((d.status, d.reason), (429, Reason::TokensTooLarge), "{max}");
            assert_eq!(d.tokens.map(|t| t.counted), Some(10u64.saturating_add(max)));
            assert_eq!(d.limits.remaining_tokens, 20000);
            // No retry header (it never fits); the log reads the reset header, which is 0.
            assert_eq!(last_tokens(&st).2, Some(0));
        }
        // Exactly the capacity fits.
        let mut i = info("k");
        i.max_output_tokens = Some(19_990);
        assert_eq!(st.decide(&i, now, sys).reason, Reason::Ok);
    }

    #[test]
    fn tpm_follows_targeting_and_precedence() {
        let now = Instant::now();
        let sys = SystemTime::now();
        // Only the listed keys have a bucket; rejections use `count`.
        let mut st = State::new(scenario(
            r#"{"tpm":{"tokens":1000},"keys":["a"],"count":1}"#,
        ));
        assert_eq!(st.decide(&thousand("b"), now, sys).tokens, None);
        assert_eq!(st.decide(&thousand("b"), now, sys).reason, Reason::Ok);
        assert_eq!(st.decide(&thousand("a"), now, sys).reason, Reason::Ok);
        assert_eq!(
            st.decide(&thousand("a"), now, sys).reason,
            Reason::TokensExhausted
        );
        // `count` used up: no longer targeted, served and not counted.
        let d = st.decide(&thousand("a"), now, sys);
        assert_eq!((d.reason, d.tokens), (Reason::Ok, None));

        // A full window wins, and its rejection is not charged.
        st.set_scenario(scenario(
            r#"{"tpm":{"tokens":2000},"limit":{"requests":1,"window_ms":60000}}"#,
        ));
        assert_eq!(st.decide(&thousand("c"), now, sys).reason, Reason::Ok);
        let w = st.decide(&thousand("c"), now, sys);
        assert_eq!(
            (w.reason, w.limits.remaining_tokens),
            (Reason::WindowFull, 1000)
        );

        // Tokens come before concurrency, and a concurrency rejection is not charged either.
        st.set_scenario(scenario(r#"{"tpm":{"tokens":3000},"max_concurrency":1}"#));
        assert_eq!(st.decide(&thousand("d"), now, sys).reason, Reason::Ok);
        let c = st.decide(&thousand("d"), now, sys);
        assert_eq!(
            (c.reason, c.limits.remaining_tokens),
            (Reason::Concurrency, 2000)
        );
        st.finish("d");
        assert_eq!(st.decide(&thousand("d"), now, sys).reason, Reason::Ok);
        st.finish("d");
        assert_eq!(st.decide(&thousand("d"), now, sys).reason, Reason::Ok);
        st.finish("d");
        assert_eq!(
            st.decide(&thousand("d"), now, sys).reason,
            Reason::TokensExhausted
        );

        // The mode answers before the bucket is looked at.
        st.set_scenario(scenario(r#"{"tpm":{"tokens":3000},"mode":"quota"}"#));
        let q = st.decide(&thousand("e"), now, sys);
        assert_eq!((q.reason, q.limits.remaining_tokens), (Reason::Mode, 3000));

        // Other dialects get their own rate-limit shape (Gemini: the per-minute one).
        st.set_scenario(scenario(r#"{"tpm":{"tokens":1000}}"#));
        let mut g = thousand("f");
        g.dialect = Dialect::Gemini;
        st.decide(&g, now, sys);
        let d = st.decide(&g, now, sys);
        assert_eq!(
            (d.reason, d.outcome),
            (Reason::TokensExhausted, Outcome::GeminiMinute)
        );
        let mut a = thousand("g");
        a.dialect = Dialect::Anthropic;
        st.decide(&a, now, sys);
        let d = st.decide(&a, now, sys);
        assert_eq!((d.reason, d.status), (Reason::TokensExhausted, 429));
        // Anthropic's default style: `retry-after` in whole seconds (60 s here).
        assert_eq!(last_tokens(&st).2, Some(60000));
    }
}
