//! Global simulator state: the scenario in force, per-key sliding windows and token buckets,
//! requests in flight and the request log. Lives behind one Mutex; every provider request takes
//! the lock once to decide and log, and once more (`State::finish`) when its answer is written.
//! `State::decide` sequences the rooms below; each owns its part of the decision.

mod counting;
mod in_flight;
mod limits;
mod log;
mod meters;
pub mod prompt_cache;
mod run;
#[cfg(test)]
mod testing;
mod window;

use std::time::{Instant, SystemTime};

use serde_json::Value;

use crate::decision::{Decision, Outcome, Reason};
use crate::dialect::Dialect;
use crate::providers;
use crate::scenario::{Mode, Scenario};
use crate::timefmt::unix_ms;
use crate::tpm::Take;

use counting::{token_wait, RequestTokens, TokenBuckets, TokenCheck};
use in_flight::{InFlight, CONCURRENCY_HINT_MS};
use log::{LogEntry, RequestLog};
use meters::{Counts, Meters};
use prompt_cache::{Prompt, PromptCache};
use run::Run;
use window::{WindowCount, Windows};

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
    /// The body's `model` (the prompt cache is per account and model).
    pub model: &'a str,
    /// An Anthropic body's prompt blocks, when it marks cache breakpoints.
    pub prompt: Option<&'a Prompt>,
}

pub struct State {
    run: Run,
    windows: Windows,
    buckets: TokenBuckets,
    log: RequestLog,
    in_flight: InFlight,
    meters: Meters,
    cache: PromptCache,
    /// xorshift64: the answers' lengths within `usage.output_tokens_range`.
    rng: u64,
}

impl State {
    pub fn new(scenario: Scenario) -> Self {
        State {
            run: Run::start(scenario),
            windows: Windows::default(),
            buckets: TokenBuckets::default(),
            log: RequestLog::default(),
            in_flight: InFlight::default(),
            meters: Meters::default(),
            cache: PromptCache::default(),
            rng: 0x9e37_79b9_7f4a_7c15,
        }
    }

    pub fn scenario(&self) -> &Scenario {
        self.run.scenario()
    }

    /// Replaces the scenario, restarts the scenario clock and forgets windows, token buckets
    /// and `count`.
    /// The request log is kept.
    pub fn set_scenario(&mut self, scenario: Scenario) {
        self.run = Run::start(scenario);
        self.windows.clear();
        self.buckets.clear();
        self.meters.clear();
        self.cache.clear();
    }

    /// Back to the default scenario with an empty log and forgotten in-flight maxima.
    pub fn reset(&mut self) {
        self.in_flight.reset_max();
        self.set_scenario(Scenario::default());
        self.log.clear();
    }

    /// Decides the answer to one provider request and logs it.
    pub fn decide(&mut self, req: &ReqInfo, now: Instant, now_sys: SystemTime) -> Decision {
        let t_ms = self.run.elapsed_ms(now);
        let targeted = self.run.targets(req.key, t_ms) && req.forced_status.is_none();
        let sc = self.run.scenario();

        let window = sc
            .limit
            .as_ref()
            .filter(|_| targeted)
            .map(|limit| self.windows.count(req.key, limit, now));
        let rng = &mut self.rng;
        let mut draw = |n: u64| {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            *rng % n.max(1)
        };
        let mut tokens = RequestTokens::of(req, sc.usage.as_ref(), &mut draw);
        // Anthropic reads what it can of the prompt from its cache; input is what is left.
        let given_input = sc.usage.as_ref().and_then(|u| u.input_tokens).is_some();
        let cache_use = match (req.dialect, req.prompt) {
            (Dialect::Anthropic, Some(p)) if !given_input => {
                Some(self.cache.look(req.key, req.model, p, now))
            }
            _ => None,
        };
        let (cache_read, cache_written) = cache_use.map_or((0, 0), |u| (u.read, u.written));
        tokens.input = tokens.input.saturating_sub(cache_read + cache_written);
        let counts = Counts {
            input: tokens.input + cache_written,
            output: tokens.output,
            admission: tokens.counted,
        };
        // A targeted request's count is looked at here and charged below, only if it is served.
        let tpm = sc
            .tpm
            .as_ref()
            .filter(|_| targeted)
            .map(|t| self.buckets.check(req.key, t.tokens, tokens.counted, now));
        let meter = if targeted {
            self.meters.check(sc, req.key, counts, now)
        } else {
            None
        };

        let in_flight = self.in_flight.now();
        let in_flight_key = self.in_flight.of(req.key);
        // Inside the scenario's outage, the rest of it (its answers tell it as the reset).
        let down_ms = sc
            .down_until_ms
            .filter(|_| targeted)
            .map(|until| (until - t_ms).ceil())
            .filter(|rest| *rest > 0.0)
            .map(|rest| rest as u64);
        let mut reason = match down_ms {
            Some(_) if req.forced_status.is_none() => Reason::Mode,
            _ => reason(req, targeted, sc, window, tpm, in_flight_key),
        };
        if let (Reason::Ok | Reason::Concurrency, Some(m)) = (reason, meter) {
            reason = m.reason;
        }
        let outcome = outcome(reason, sc, req.dialect);

        let bucket = tpm.and_then(|check| {
            self.buckets
                .settle(req.key, &check, reason == Reason::Ok, now)
        });
        if reason == Reason::Ok && targeted {
            self.meters.charge(sc, req.key, counts, now);
        }
        if let (Reason::Ok, Some(p), Some(used)) = (reason, req.prompt, cache_use.as_ref()) {
            self.cache.serve(req.key, req.model, p, used, now);
        }
        let meter = meter.filter(|m| m.reason == reason);
        let hint_ms = if reason == Reason::Concurrency {
            CONCURRENCY_HINT_MS
        } else {
            // A scenario with an outage says `retry_after_s` in the outage only; after it, the
            // window says when a request would be admitted.
            sc.retry_after_s
                .filter(|_| sc.down_until_ms.is_none() || down_ms.is_some())
                .map(|s| (s * 1000.0).ceil() as u64)
                .or(window.and_then(|w| w.admit_ms))
                .or(token_wait(reason, tpm, bucket))
                .or(meter.map(|m| m.wait_ms.max(1)))
                .unwrap_or(1000)
        };
        let mut limits = limits::resolve(sc, window, bucket, &tokens);
        if targeted {
            self.meters.report(sc, req.key, &mut limits, now);
        }
        let dimension = meter.map(|m| m.dimension).or(sc.dimension);
        let reset_ms = down_ms.map_or(hint_ms, |rest| rest.max(1));
        let exhausted = limits::exhaust(&mut limits, reason, outcome, dimension, reset_ms);

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
            input_tokens: tokens.input,
            output_tokens: tokens.output,
            cache_read_tokens: cache_read,
            cache_creation_tokens: cache_written,
            tokens: tpm.map(|check| check.usage),
            latency_ms: sc.latency_ms.unwrap_or(0),
            stream_delay_ms: sc.stream_delay_ms.unwrap_or(0),
            now_unix_ms,
            in_flight: reason == Reason::Ok,
        };
        if reason.is_rejection() {
            self.run.count_rejection();
        }
        if decision.in_flight {
            self.in_flight.start(req.key);
        }
        self.log.record(LogEntry {
            t_ms: (t_ms * 1000.0).round() / 1000.0,
            unix_ms: now_unix_ms,
            method: req.method.to_string(),
            path: req.path.to_string(),
            key: req.key.to_string(),
            dialect: req.dialect.name(),
            status,
            decision: reason,
            hint_ms: providers::sent_hint_ms(req.dialect, &decision),
            window_count: window.map(|w| w.count),
            counted_tokens: tpm.map(|check| check.usage.counted),
            tokens_remaining: bucket.map(|b| b.remaining),
            input_tokens: decision.input_tokens,
            cache_read_tokens: decision.cache_read_tokens,
            cache_creation_tokens: decision.cache_creation_tokens,
            output_tokens: decision.output_tokens,
            in_flight,
            in_flight_key,
        });
        decision
    }

    /// A request counted in flight (`Decision::in_flight`) has been answered.
    pub fn finish(&mut self, key: &str) {
        self.in_flight.finish(key);
    }

    /// The `GET /_sim/requests` document.
    pub fn requests_json(&self) -> Value {
        self.log
            .document(self.run.elapsed_ms(Instant::now()), &self.in_flight)
    }
}

/// Why a request gets its answer, the first that applies. Tokens and concurrency only reject
/// what would otherwise succeed.
fn reason(
    req: &ReqInfo,
    targeted: bool,
    sc: &Scenario,
    window: Option<WindowCount>,
    tpm: Option<TokenCheck>,
    in_flight_key: u64,
) -> Reason {
    let take = tpm.map(|check| check.take);
    if req.forced_status.is_some() {
        Reason::MethodNotAllowed
    } else if !targeted {
        Reason::Ok
    } else if window.is_some_and(|w| w.admit_ms.is_some()) {
        Reason::WindowFull
    } else if sc.limit.is_none() && sc.mode != Mode::Ok {
        Reason::Mode
    } else if let Some(Take::Wait { .. }) = take {
        Reason::TokensExhausted
    } else if let Some(Take::TooLarge) = take {
        Reason::TokensTooLarge
    } else if sc.max_concurrency.is_some_and(|max| in_flight_key >= max) {
        Reason::Concurrency
    } else {
        Reason::Ok
    }
}

/// What a request gets for its reason: the scenario's mode for a full window or the mode
/// itself, a rate limit for tokens and concurrency, in the dialect's own shape (Gemini's are
/// per minute or per day).
fn outcome(reason: Reason, sc: &Scenario, dialect: Dialect) -> Outcome {
    let outcome = match reason {
        Reason::Ok | Reason::MethodNotAllowed => Outcome::Ok,
        Reason::Concurrency
        | Reason::TokensExhausted
        | Reason::TokensTooLarge
        | Reason::InputTokensExhausted
        | Reason::OutputTokensExhausted
        | Reason::DayExhausted => Outcome::RateLimited,
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
    match (dialect, outcome) {
        (Dialect::Gemini, Outcome::RateLimited) => Outcome::GeminiMinute,
        (Dialect::Gemini, Outcome::Quota) => Outcome::GeminiDay,
        (_, o) => o,
    }
}
