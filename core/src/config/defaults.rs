//! What every field left out of the configuration becomes, in one place: `Config::default()`
//! is built from these, and the rules read them from here.

use super::model::{
    Config, Cooldown, Hold, HoldClass, Match, OnError, OutputRule, Pool, RetryAfter, Scope, Settle,
};
use crate::classify::Dialect;

// The top level.

pub const DEFAULT_ACCOUNT_HEADERS: [&str; 4] =
    ["x-api-key", "authorization", "api-key", "x-goog-api-key"];
const PREEMPTIVE: bool = true;
const MAX_KEYS: u64 = 10_000;

const RETRY_AFTER: RetryAfter = RetryAfter {
    default_ms: 1000,
    max_ms: 60_000,
    jitter: 0.2,
    escalate: false,
};

const COOLDOWN: Cooldown = Cooldown {
    enabled: true,
    max_ms: 300_000,
    quota_ms: 300_000,
};

// `hold`: on, with the contract's numbers.

const HOLD_MAX_MS: u64 = 10_000;
const HOLD_MAX_HELD: u64 = 1000;
const HOLD_MARGIN_MS: u64 = 2000;
pub const DEFAULT_DEADLINE_HEADERS: [&str; 3] = [
    "x-stainless-read-timeout",
    "x-stainless-timeout",
    "x-envoy-expected-rq-timeout-ms",
];
/// The name of the implicit class of held requests that match no configured class.
pub const DEFAULT_CLASS: &str = "default";
pub(super) const CLASS_WEIGHT: u64 = 1;

// `pools[]`.

/// The name of the implicit pool for requests that match no configured pool.
pub const DEFAULT_POOL: &str = "default";
pub(super) const DIALECT: Dialect = Dialect::Auto;

// `limits[]`.

/// A rate limit's burst: the window's amount (a minute's, or a day's).
pub(super) fn burst(per_window: u64) -> u64 {
    per_window
}
pub(super) const SLOT_LEASE_MS: u64 = 600_000;
pub(super) const RESERVE: bool = true;
/// The output reserved for a request that sets no output limit (`default_output_tokens`).
pub const DEFAULT_OUTPUT_TOKENS: u64 = 1024;
pub(super) const SETTLE: Settle = Settle::Auto;
pub(super) const COUNT_CACHE_READS: bool = false;
pub(super) const OUTPUT: OutputRule = OutputRule::Generated;
/// The least a predicted output reserves (`min_output_tokens`).
pub const MIN_OUTPUT_TOKENS: u64 = 64;
pub(super) const SCOPE: Scope = Scope::Local;

// `fleet` (the section itself is off unless given: it needs a cluster).

/// The default RLS domain of fleet limits (Limitador's namespace).
pub const DEFAULT_FLEET_DOMAIN: &str = "llm_governor";
/// How long a call to the fleet's rate-limit service may take before the fallback applies.
pub const DEFAULT_FLEET_TIMEOUT_MS: u64 = 50;
pub(super) const ON_ERROR: OnError = OnError::Local;
pub(super) const RESERVATIONS: bool = true;

impl Default for Config {
    fn default() -> Self {
        Config {
            pools: vec![unmatched_pool()],
            account_headers: owned(&DEFAULT_ACCOUNT_HEADERS),
            retry_after: RETRY_AFTER,
            cooldown: COOLDOWN,
            preemptive: PREEMPTIVE,
            limits: Vec::new(),
            max_keys: MAX_KEYS,
            hold: Hold {
                max_ms: HOLD_MAX_MS,
                max_held: HOLD_MAX_HELD,
                margin_ms: HOLD_MARGIN_MS,
                deadline_headers: owned(&DEFAULT_DEADLINE_HEADERS),
                fair_key: None,
                classes: vec![unmatched_class()],
            },
            fleet: None,
        }
    }
}

/// The implicit pool, last in `Config::pools`, for requests that match no configured pool.
pub(super) fn unmatched_pool() -> Pool {
    Pool {
        name: DEFAULT_POOL.to_string(),
        matcher: Match::default(),
        dialect: DIALECT,
        fallback: Vec::new(),
        account: None,
    }
}

/// The implicit class, last in `Hold::classes`, for held requests that match no configured
/// class: the hold's own longest hold and bound.
pub(super) fn unmatched_class() -> HoldClass {
    HoldClass {
        name: DEFAULT_CLASS.to_string(),
        matcher: Match::default(),
        weight: CLASS_WEIGHT,
        max_ms: None,
        max_held: None,
    }
}

fn owned(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}
