//! The configuration as written: which fields exist, in the order they are checked, and the
//! bounds of each value. Nothing here relates one field to another (that is `rules`).

use super::values::{
    Authority, Bounded, ClusterName, DialectName, Domain, Flag, Fraction, HeaderName, Int, KeySpec,
    Label, OnErrorSpec, OutputSpec, PathPrefix, ScopeSpec, SettleSpec, StatName, Text,
    UncheckedInt,
};
use serde::Deserialize;

// The bounds of values (what a field left out becomes is in `defaults`).
const MAX_POOLS: usize = 64;
const MAX_LIMITS: usize = 64;
const MAX_ACCOUNT_HEADERS: usize = 16;
pub(super) const MAX_DURATION_MS: u64 = 7 * 24 * 3600 * 1000;
/// The largest amount of a rate field, per minute or per day.
pub(super) const MAX_PER_WINDOW: u64 = 1_000_000_000;
const MAX_KEYS: u64 = 10_000_000;
/// Envoy's `stream_idle_timeout` is 5 minutes by default, and a held request sends nothing.
const MAX_HOLD_MS: u64 = 300_000;
const MAX_HELD: u64 = 100_000;
/// Class names appear in stats names: a bounded set, as pools.
const MAX_CLASSES: usize = 16;
/// Weights share releases: 1000 to 1 is as uneven as a share gets before it is a priority.
const MAX_WEIGHT: u64 = 1000;
pub(super) const MAX_IN_FLIGHT: u64 = 1_000_000;
const MAX_FLEET_TIMEOUT_MS: u64 = 10_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ConfigDto {
    pub(super) pools: Option<Bounded<PoolDto, MAX_POOLS>>,
    pub(super) account_headers: Option<Bounded<HeaderName, MAX_ACCOUNT_HEADERS>>,
    pub(super) retry_after: Option<RetryAfterDto>,
    pub(super) cooldown: Option<CooldownDto>,
    pub(super) preemptive: Option<Flag>,
    pub(super) limits: Option<Bounded<LimitDto, MAX_LIMITS>>,
    pub(super) max_keys: Option<Int<1, MAX_KEYS>>,
    pub(super) hold: Option<HoldDto>,
    pub(super) fleet: Option<FleetDto>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FleetDto {
    pub(super) cluster: Option<ClusterName>,
    pub(super) domain: Option<Domain>,
    pub(super) timeout_ms: Option<Int<1, MAX_FLEET_TIMEOUT_MS>>,
    pub(super) on_error: Option<OnErrorSpec>,
    pub(super) reservations: Option<Flag>,
    pub(super) cooldowns: Option<Flag>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PoolDto {
    pub(super) name: Option<StatName>,
    pub(super) r#match: Option<MatchDto>,
    pub(super) dialect: Option<DialectName>,
    pub(super) fallback: Option<Bounded<Text, MAX_POOLS>>,
    pub(super) account: Option<Label>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MatchDto {
    pub(super) path_prefix: Option<PathPrefix>,
    pub(super) authority: Option<Authority>,
    pub(super) header: Option<HeaderMatchDto>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HeaderMatchDto {
    pub(super) name: Option<HeaderName>,
    pub(super) value: Option<Text>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RetryAfterDto {
    pub(super) default_ms: Option<Int<1, MAX_DURATION_MS>>,
    pub(super) max_ms: Option<Int<1, MAX_DURATION_MS>>,
    pub(super) jitter: Option<Fraction>,
    pub(super) escalate: Option<Flag>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CooldownDto {
    pub(super) enabled: Option<Flag>,
    pub(super) max_ms: Option<Int<1, MAX_DURATION_MS>>,
    pub(super) quota_ms: Option<Int<1, MAX_DURATION_MS>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LimitDto {
    pub(super) name: Option<StatName>,
    pub(super) key: Option<KeySpec>,
    // Which of these may be given depends on the others, and that is said before what is
    // wrong with a value (`burst: applies to ... not max_in_flight`, not `must be > 0`).
    pub(super) requests_per_minute: Option<UncheckedInt>,
    pub(super) requests_per_day: Option<UncheckedInt>,
    pub(super) tokens_per_minute: Option<UncheckedInt>,
    pub(super) tokens_per_day: Option<UncheckedInt>,
    pub(super) input_tokens_per_minute: Option<UncheckedInt>,
    pub(super) output_tokens_per_minute: Option<UncheckedInt>,
    pub(super) max_in_flight: Option<UncheckedInt>,
    pub(super) burst: Option<UncheckedInt>,
    pub(super) slot_lease_ms: Option<UncheckedInt>,
    pub(super) reserve: Option<Flag>,
    pub(super) default_output_tokens: Option<UncheckedInt>,
    pub(super) settle: Option<SettleSpec>,
    pub(super) count_cache_reads: Option<Flag>,
    pub(super) output: Option<OutputSpec>,
    pub(super) min_output_tokens: Option<UncheckedInt>,
    pub(super) scope: Option<ScopeSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HoldDto {
    pub(super) max_ms: Option<Int<0, MAX_HOLD_MS>>,
    pub(super) max_held: Option<Int<0, MAX_HELD>>,
    pub(super) margin_ms: Option<Int<0, MAX_HOLD_MS>>,
    pub(super) deadline_headers: Option<Bounded<HeaderName, MAX_ACCOUNT_HEADERS>>,
    pub(super) fair_key: Option<KeySpec>,
    pub(super) classes: Option<Bounded<HoldClassDto, MAX_CLASSES>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HoldClassDto {
    pub(super) name: Option<StatName>,
    pub(super) r#match: Option<MatchDto>,
    pub(super) weight: Option<Int<1, MAX_WEIGHT>>,
    pub(super) max_ms: Option<Int<0, MAX_HOLD_MS>>,
    pub(super) max_held: Option<Int<0, MAX_HELD>>,
}
