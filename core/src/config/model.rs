//! The validated configuration the rest of the core reads: every field resolved, every rule
//! between fields checked (`rules`), every default applied (`defaults`).

use crate::classify::Dialect;
use std::fmt;

/// A configuration error: the JSON path of the offending field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "{}: {}", self.field, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

/// The validated configuration. `Config::default()` (in `defaults.rs`) is what `{}` gives.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Configured pools, then the implicit `default` pool last.
    pub pools: Vec<Pool>,
    pub account_headers: Vec<String>,
    pub retry_after: RetryAfter,
    pub cooldown: Cooldown,
    pub preemptive: bool,
    pub limits: Vec<Limit>,
    pub max_keys: u64,
    pub hold: Hold,
    /// The rate-limit service several Envoys share budgets through (`limits[].scope: fleet`).
    pub fleet: Option<Fleet>,
}

/// The rate-limit service a fleet of Envoys shares its `scope: fleet` budgets through.
#[derive(Debug, Clone, PartialEq)]
pub struct Fleet {
    /// The Envoy cluster (HTTP/2) of the service.
    pub cluster: String,
    /// The RLS domain (Limitador's namespace).
    pub domain: String,
    /// How long a call may take before the fallback applies.
    pub timeout_ms: u64,
    pub on_error: OnError,
    /// Token budgets use Limitador's Reserve / Commit (false: charged at admission, topped up
    /// after, never refunded).
    pub reservations: bool,
    /// Cooldowns and the pace after them are the fleet's: one probe per provider round and one
    /// release pace for every Envoy (a turn held on the service; needs Reserve / Commit).
    pub cooldowns: bool,
}

/// What a fleet limit does while the service cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// This Envoy's own bucket of the same rate decides.
    Local,
    /// The request goes.
    Allow,
    /// The request is answered locally (429).
    Deny,
}

/// Where a limit is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// In this Envoy's shared data.
    Local,
    /// By the fleet's rate-limit service.
    Fleet,
}

/// Holding requests through short waits instead of answering them locally.
#[derive(Debug, Clone, PartialEq)]
pub struct Hold {
    /// The longest wait a request is held through; 0 turns holding off.
    pub max_ms: u64,
    /// At most this many requests held at once on one worker.
    pub max_held: u64,
    /// Taken off the client's own timeout: a held request is released or answered this long
    /// before the client would give up.
    pub margin_ms: u64,
    /// Where the client's timeout is read from, first present wins.
    pub deadline_headers: Vec<String>,
    /// Among the requests held for one (pool, account), releases go to the next value of this
    /// key in turn (None: arrival order).
    pub fair_key: Option<LimitKey>,
    /// The configured classes in order, then the implicit `default` class last (the only one
    /// when none is configured): releases are shared by weight among those with requests
    /// waiting.
    pub classes: Vec<HoldClass>,
}

impl Hold {
    /// Some request may be held: a class of it holds through some wait.
    pub fn enabled(&self) -> bool {
        (0..self.classes.len()).any(|c| self.max_ms_of(c) > 0 && self.max_held_of(c) > 0)
    }

    /// The longest hold of class `class`: its own, else `hold.max_ms`.
    pub fn max_ms_of(&self, class: usize) -> u64 {
        self.classes
            .get(class)
            .and_then(|c| c.max_ms)
            .unwrap_or(self.max_ms)
    }

    /// The classes whose stats hosts define: every class with `hold.classes`, none without.
    pub fn stat_classes(&self) -> Vec<&str> {
        match self.classes.len() {
            1 => Vec::new(),
            _ => self.classes.iter().map(|c| c.name.as_str()).collect(),
        }
    }

    /// How many of class `class` one worker holds at most: its own bound within
    /// `hold.max_held`, else `hold.max_held`.
    pub fn max_held_of(&self, class: usize) -> u64 {
        let own = self.classes.get(class).and_then(|c| c.max_held);
        own.map_or(self.max_held, |n| n.min(self.max_held))
    }
}

/// A class of held requests: which requests (matched as pools match), their share of the
/// releases, their longest hold and how many of them one worker holds at most (None: the
/// hold's own).
#[derive(Debug, Clone, PartialEq)]
pub struct HoldClass {
    pub name: String,
    pub matcher: Match,
    pub weight: u64,
    pub max_ms: Option<u64>,
    pub max_held: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    pub name: String,
    pub matcher: Match,
    pub dialect: Dialect,
    /// Pools that can serve the same requests, in order of preference (indices into `pools`).
    pub fallback: Vec<usize>,
    /// The account of a pool whose credential Envoy injects, as a label (hashed like a
    /// credential); None: the client's own credential is the account.
    pub account: Option<String>,
}

/// All given conditions must hold; an empty match matches every request.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Match {
    pub path_prefix: Option<String>,
    pub authority: Option<String>,
    pub header: Option<(String, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryAfter {
    pub default_ms: u64,
    pub max_ms: u64,
    pub jitter: f64,
    /// Tell clients twice as long per consecutive failed cooldown round (off by default: the
    /// contract's `retry-after-ms` is the provider's time plus jitter).
    pub escalate: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cooldown {
    pub enabled: bool,
    pub max_ms: u64,
    pub quota_ms: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum LimitKey {
    Header(String),
    Account,
    Pool,
    /// The request's model (the body's `model`, Azure's deployment, Gemini's model path), and
    /// with `header`, that header's value too (`header:<name>+model`).
    Model {
        header: Option<String>,
    },
}

impl LimitKey {
    /// The keying header, if any.
    pub fn header(&self) -> Option<&str> {
        match self {
            LimitKey::Header(h) | LimitKey::Model { header: Some(h) } => Some(h),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    Tokens,
    /// At most `per_window` (the cap) requests of one key upstream at once.
    InFlight,
}

/// What a token limit counts of a request, as its provider counts that dimension (`counting`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counts {
    /// Input and output together (`tokens_per_minute`, `tokens_per_day`).
    Tokens,
    /// Input only (`input_tokens_per_minute`, Anthropic's ITPM).
    InputTokens,
    /// Output only (`output_tokens_per_minute`, Anthropic's OTPM).
    OutputTokens,
}

impl Counts {
    /// Whether the limit counts a request's input, its output.
    pub fn input(self) -> bool {
        self != Counts::OutputTokens
    }
    pub fn output(self) -> bool {
        self != Counts::InputTokens
    }
}

/// How the output of a request counts where its provider counts the tokens generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputRule {
    /// Predicted from recent usage before the call, settled with the tokens generated.
    Generated,
    /// The request's `max_tokens` is reserved (Anthropic's older documented rule), settled
    /// with the tokens generated.
    MaxTokens,
}

/// The window of a rate field: a minute, or a day.
pub const MINUTE_S: u64 = 60;
pub const DAY_S: u64 = 86_400;

#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    pub name: String,
    pub key: LimitKey,
    pub kind: LimitKind,
    /// What a token limit counts (`Tokens` for other kinds: never read).
    pub counts: Counts,
    /// Requests or tokens per window; for `InFlight`, the cap.
    pub per_window: u64,
    /// The rate field's window in seconds: `MINUTE_S` or `DAY_S` (the bucket refills
    /// `per_window` evenly over it; `RateLimit-Policy` says `w=` this).
    pub window_s: u64,
    pub burst: u64,
    /// `InFlight` only: how long a slot whose stream never reported its end (its VM was
    /// replaced) is counted at most.
    pub slot_lease_ms: u64,
    /// `Tokens` only: take what the request is predicted to count before forwarding and
    /// settle with the reported usage at the end (false: admit while a token is left and
    /// charge the usage after the response).
    pub reserve: bool,
    /// `Tokens` only: the output reserved for a request that sets no output limit (and, where
    /// output is predicted, before any usage of its model was seen).
    pub default_output_tokens: u64,
    /// `Tokens` that reserve: what the reservation becomes when the stream ends.
    pub settle: Settle,
    /// `Tokens` counting input: Anthropic's cache reads count too (models that count them).
    pub count_cache_reads: bool,
    /// `Tokens` counting output, where the provider counts the tokens generated.
    pub output: OutputRule,
    /// `Tokens` counting output, predicted: the least a prediction reserves.
    pub min_output_tokens: u64,
    pub scope: Scope,
}

impl Limit {
    /// The window in ms.
    pub fn window_ms(&self) -> u64 {
        self.window_s.saturating_mul(1000)
    }
}

/// What a token reservation becomes at the end of its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// As the provider behind the request counts: `Reservation` for OpenAI and Azure OpenAI
    /// (their TPM limiters count at admission), `Usage` for the others.
    Auto,
    /// The usage the provider reported (the difference given back or charged), as Anthropic
    /// adjusts its output-token limits at the end of a request.
    Usage,
    /// It stays what was counted at admission, as OpenAI's TPM counts a request: the larger of
    /// the estimate and the body's characters / 4, plus its output limit, never adjusted.
    Reservation,
}

/// An error on `field`, a JSON path (empty for the file as a whole).
pub(super) fn err(field: &str, reason: String) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        reason,
    }
}
