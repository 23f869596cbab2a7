//! The stats the filter exports, by pool. Names are the contract's; the host defines them.

use crate::ratelimit::Dimension;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    UpstreamRateLimited,
    UpstreamQuotaExhausted,
    UpstreamOverloaded,
    LocalRejectCooldown,
    LocalRejectLimit,
    LocalRejectQuota,
    OverflowKeys,
    /// A 429 whose exhausted dimension was known, by dimension.
    Exhausted(Dimension),
    /// A cooldown started from headers reporting nothing left, before any 429.
    PreemptiveCooldown,
    /// A shared-data update gave up after repeated CAS conflicts (the request was admitted).
    StoreContention,
    /// Envoy never delivered the body of a held error response (missing
    /// `allow_on_headers_stop_iteration`); it was classified from status and headers.
    BodyUnavailable,
    /// A request was held instead of answered locally.
    Held,
    /// A held request went upstream.
    HoldReleased,
    /// A held request was answered locally after waiting (its wait outgrew its limit).
    HoldExpired,
    /// A request of this pool was steered to one of its fallbacks.
    Failover,
    /// An attempt the client marked as a retry (`x-stainless-retry-count` > 0).
    ClientRetries,
    /// A call that succeeded only after a retry (a 2xx to an attempt marked as a retry).
    SucceededAfterRetry,
    /// The fleet's service answered a call: OK (the budget had room; a commit was taken).
    FleetCallsOk,
    /// The fleet's service answered a call: over the limit (the request was held or answered).
    FleetCallsOverLimit,
    /// A call to the fleet's service failed: timeout, unavailable, unreadable, not sent.
    FleetErrors,
    /// A request the fleet's fallback (`fleet.on_error`) decided, because a call failed.
    FleetFallback,
}

impl Counter {
    pub const ALL: [Counter; 24] = [
        Counter::UpstreamRateLimited,
        Counter::UpstreamQuotaExhausted,
        Counter::UpstreamOverloaded,
        Counter::LocalRejectCooldown,
        Counter::LocalRejectLimit,
        Counter::LocalRejectQuota,
        Counter::OverflowKeys,
        Counter::Exhausted(Dimension::Requests),
        Counter::Exhausted(Dimension::Tokens),
        Counter::Exhausted(Dimension::InputTokens),
        Counter::Exhausted(Dimension::OutputTokens),
        Counter::PreemptiveCooldown,
        Counter::StoreContention,
        Counter::BodyUnavailable,
        Counter::Held,
        Counter::HoldReleased,
        Counter::HoldExpired,
        Counter::Failover,
        Counter::ClientRetries,
        Counter::SucceededAfterRetry,
        Counter::FleetCallsOk,
        Counter::FleetCallsOverLimit,
        Counter::FleetErrors,
        Counter::FleetFallback,
    ];

    pub fn index(self) -> usize {
        Counter::ALL.iter().position(|c| *c == self).unwrap_or(0)
    }

    pub fn name(self) -> &'static str {
        match self {
            Counter::UpstreamRateLimited => "upstream_rate_limited",
            Counter::UpstreamQuotaExhausted => "upstream_quota_exhausted",
            Counter::UpstreamOverloaded => "upstream_overloaded",
            Counter::LocalRejectCooldown => "local_reject_cooldown",
            Counter::LocalRejectLimit => "local_reject_limit",
            Counter::LocalRejectQuota => "local_reject_quota",
            Counter::OverflowKeys => "overflow_keys",
            Counter::Exhausted(Dimension::Requests) => "exhausted_requests",
            Counter::Exhausted(Dimension::Tokens) => "exhausted_tokens",
            Counter::Exhausted(Dimension::InputTokens) => "exhausted_input_tokens",
            Counter::Exhausted(Dimension::OutputTokens) => "exhausted_output_tokens",
            Counter::PreemptiveCooldown => "preemptive_cooldown",
            Counter::StoreContention => "store_contention",
            Counter::BodyUnavailable => "body_unavailable",
            Counter::Held => "held",
            Counter::HoldReleased => "hold_released",
            Counter::HoldExpired => "hold_expired",
            Counter::Failover => "failover",
            Counter::ClientRetries => "client_retries",
            Counter::SucceededAfterRetry => "succeeded_after_retry",
            Counter::FleetCallsOk => "fleet_calls_ok",
            Counter::FleetCallsOverLimit => "fleet_calls_over_limit",
            Counter::FleetErrors => "fleet_errors",
            Counter::FleetFallback => "fleet_fallback",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gauge {
    RemainingRequests,
    RemainingTokens,
    RemainingInputTokens,
    RemainingOutputTokens,
    LimitRequests,
    LimitTokens,
    ResetRequestsMs,
    ResetTokensMs,
    /// Requests held now, summed over workers (each adds and subtracts its own).
    HeldRequests,
    /// Requests upstream now under a `max_in_flight` limit, summed over workers.
    InFlight,
}

impl Gauge {
    pub const ALL: [Gauge; 10] = [
        Gauge::RemainingRequests,
        Gauge::RemainingTokens,
        Gauge::RemainingInputTokens,
        Gauge::RemainingOutputTokens,
        Gauge::LimitRequests,
        Gauge::LimitTokens,
        Gauge::ResetRequestsMs,
        Gauge::ResetTokensMs,
        Gauge::HeldRequests,
        Gauge::InFlight,
    ];

    pub fn index(self) -> usize {
        Gauge::ALL.iter().position(|g| *g == self).unwrap_or(0)
    }

    pub fn name(self) -> &'static str {
        match self {
            Gauge::RemainingRequests => "remaining_requests",
            Gauge::RemainingTokens => "remaining_tokens",
            Gauge::RemainingInputTokens => "remaining_input_tokens",
            Gauge::RemainingOutputTokens => "remaining_output_tokens",
            Gauge::LimitRequests => "limit_requests",
            Gauge::LimitTokens => "limit_tokens",
            Gauge::ResetRequestsMs => "reset_requests_ms",
            Gauge::ResetTokensMs => "reset_tokens_ms",
            Gauge::HeldRequests => "held_requests",
            Gauge::InFlight => "in_flight",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Histogram {
    /// What clients were told to wait.
    RetryAfterMs,
    /// How long held requests were held.
    HoldMs,
    /// How long the fleet's service took to answer a call (or to fail).
    FleetCallMs,
    /// How far the input a token limit reserved was from what the provider counted, in % of
    /// what it counted (cache reads predicted, or not).
    InputPredictionErrorPct,
    /// The same for a predicted output (where the provider counts tokens generated).
    OutputPredictionErrorPct,
}

impl Histogram {
    pub const ALL: [Histogram; 5] = [
        Histogram::RetryAfterMs,
        Histogram::HoldMs,
        Histogram::FleetCallMs,
        Histogram::InputPredictionErrorPct,
        Histogram::OutputPredictionErrorPct,
    ];

    pub fn index(self) -> usize {
        Histogram::ALL.iter().position(|h| *h == self).unwrap_or(0)
    }

    pub fn name(self) -> &'static str {
        match self {
            Histogram::RetryAfterMs => "retry_after_ms",
            Histogram::HoldMs => "hold_ms",
            Histogram::FleetCallMs => "fleet_call_ms",
            Histogram::InputPredictionErrorPct => "input_prediction_error_pct",
            Histogram::OutputPredictionErrorPct => "output_prediction_error_pct",
        }
    }
}

/// A stat of one hold class of one pool (with `hold.classes` only): the hold's own stats of
/// the requests of that class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClassStat {
    /// A request of the class was held.
    Held,
    /// A held request of the class went upstream.
    Released,
    /// A held request of the class was answered locally after waiting.
    Expired,
    /// Requests of the class held now, summed over workers.
    HeldRequests,
    /// How long held requests of the class were held.
    HoldMs,
    /// The class's longest hold (its `max_ms`), set when one of its requests is held: what
    /// `HoldMs` is read against.
    HoldLimitMs,
}

impl ClassStat {
    pub const ALL: [ClassStat; 6] = [
        ClassStat::Held,
        ClassStat::Released,
        ClassStat::Expired,
        ClassStat::HeldRequests,
        ClassStat::HoldMs,
        ClassStat::HoldLimitMs,
    ];

    pub fn index(self) -> usize {
        ClassStat::ALL.iter().position(|c| *c == self).unwrap_or(0)
    }

    /// The pool's stat of the same meaning: a class stat is named as it.
    pub fn name(self) -> &'static str {
        match self {
            ClassStat::Held => Counter::Held.name(),
            ClassStat::Released => Counter::HoldReleased.name(),
            ClassStat::Expired => Counter::HoldExpired.name(),
            ClassStat::HeldRequests => Gauge::HeldRequests.name(),
            ClassStat::HoldMs => Histogram::HoldMs.name(),
            ClassStat::HoldLimitMs => "hold_limit_ms",
        }
    }

    pub fn kind(self) -> Kind {
        match self {
            ClassStat::HeldRequests | ClassStat::HoldLimitMs => Kind::Gauge,
            ClassStat::HoldMs => Kind::Histogram,
            _ => Kind::Counter,
        }
    }

    /// The family of a host with real labels: `llm_governor.class_<stat>{llm_pool, class}`.
    pub fn family(self) -> &'static str {
        match self {
            ClassStat::Held => "llm_governor.class_held",
            ClassStat::Released => "llm_governor.class_hold_released",
            ClassStat::Expired => "llm_governor.class_hold_expired",
            ClassStat::HeldRequests => "llm_governor.class_held_requests",
            ClassStat::HoldMs => "llm_governor.class_hold_ms",
            ClassStat::HoldLimitMs => "llm_governor.class_hold_limit_ms",
        }
    }
}

/// The label of a hold class's stats in a host with real labels, and the tag the shipped
/// `stats_tags` give the wasm build's: one name for both, as `POOL_LABEL`.
pub const CLASS_LABEL: &str = "class";

/// Full stat name (Envoy adds the `wasmcustom.` namespace in front).
pub fn stat_name(pool: &str, metric: &str) -> String {
    format!("llm_governor.pool.{pool}.{metric}")
}

/// Full stat name of a hold class's stat: `llm_governor.pool.<pool>.class.<class>.<stat>`.
pub fn class_stat_name(pool: &str, class: &str, stat: ClassStat) -> String {
    format!("llm_governor.pool.{pool}.class.{class}.{}", stat.name())
}

/// The name of the pool label of a host with real labels: `llm_pool`, the label the wasm
/// build's shipped `stats_tags` regex gives, so the dashboard and the alerts select, group and
/// label by one name whichever build Envoy runs (Envoy 1.40 still names the series differently:
/// it prefixes a dynamic module's with `envoy_dynamicmodulescustom_`).
pub const POOL_LABEL: &str = "llm_pool";

/// A stat as a host with real labels defines it (the dynamic-module host): one family per kind
/// of stat, labelled `llm_pool` (`POOL_LABEL`) and, where the wasm name folds a second
/// dimension into the name, by that too: `upstream_rate_limited` is
/// `llm_governor.upstream{llm_pool, class="rate_limited"}`, `local_reject_cooldown` is
/// `llm_governor.local_reject{llm_pool, reason="cooldown"}`, `exhausted_tokens` is
/// `llm_governor.exhausted{llm_pool, dimension="tokens"}`, `fleet_calls_ok` is
/// `llm_governor.fleet_calls{llm_pool, outcome="ok"}`; every other stat is
/// `llm_governor.<stat>{llm_pool}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    /// The family's name (`llm_governor.upstream`).
    pub name: &'static str,
    /// The label beside `pool`, with this stat's value of it.
    pub label: Option<(&'static str, &'static str)>,
}

/// Families whose stats differ by a second label: (name prefix of the stats, family, label).
const LABELLED: [(&str, &str, &str); 4] = [
    ("upstream_", "llm_governor.upstream", "class"),
    ("local_reject_", "llm_governor.local_reject", "reason"),
    ("exhausted_", "llm_governor.exhausted", "dimension"),
    ("fleet_calls_", "llm_governor.fleet_calls", "outcome"),
];

impl Family {
    /// The family of the stat named `stat` (`Counter::name`, `Gauge::name`, `Histogram::name`).
    pub fn of(stat: &'static str) -> Family {
        for (prefix, name, label) in LABELLED {
            if let Some(value) = stat.strip_prefix(prefix) {
                return Family {
                    name,
                    label: Some((label, value)),
                };
            }
        }
        let name = FAMILIES
            .iter()
            .find(|(s, _)| *s == stat)
            .map_or("llm_governor.unknown", |(_, f)| f);
        Family { name, label: None }
    }
}

/// `llm_governor.<stat>` for every stat that is its own family (a `&'static str` each, as the
/// host's define call keeps no copy it does not make itself).
const FAMILIES: [(&str, &str); 27] = [
    ("overflow_keys", "llm_governor.overflow_keys"),
    ("preemptive_cooldown", "llm_governor.preemptive_cooldown"),
    ("store_contention", "llm_governor.store_contention"),
    ("body_unavailable", "llm_governor.body_unavailable"),
    ("held", "llm_governor.held"),
    ("hold_released", "llm_governor.hold_released"),
    ("hold_expired", "llm_governor.hold_expired"),
    ("failover", "llm_governor.failover"),
    ("client_retries", "llm_governor.client_retries"),
    (
        "succeeded_after_retry",
        "llm_governor.succeeded_after_retry",
    ),
    ("remaining_requests", "llm_governor.remaining_requests"),
    ("remaining_tokens", "llm_governor.remaining_tokens"),
    (
        "remaining_input_tokens",
        "llm_governor.remaining_input_tokens",
    ),
    (
        "remaining_output_tokens",
        "llm_governor.remaining_output_tokens",
    ),
    ("limit_requests", "llm_governor.limit_requests"),
    ("limit_tokens", "llm_governor.limit_tokens"),
    ("reset_requests_ms", "llm_governor.reset_requests_ms"),
    ("reset_tokens_ms", "llm_governor.reset_tokens_ms"),
    ("held_requests", "llm_governor.held_requests"),
    ("in_flight", "llm_governor.in_flight"),
    ("retry_after_ms", "llm_governor.retry_after_ms"),
    ("hold_ms", "llm_governor.hold_ms"),
    ("fleet_errors", "llm_governor.fleet_errors"),
    ("fleet_fallback", "llm_governor.fleet_fallback"),
    ("fleet_call_ms", "llm_governor.fleet_call_ms"),
    (
        "input_prediction_error_pct",
        "llm_governor.input_prediction_error_pct",
    ),
    (
        "output_prediction_error_pct",
        "llm_governor.output_prediction_error_pct",
    ),
];

/// Where stats go. `pool` is the index of the pool in the configuration.
pub trait Metrics {
    fn count(&mut self, pool: usize, c: Counter);
    /// Set a gauge (last writer wins across workers).
    fn gauge(&mut self, pool: usize, g: Gauge, value: u64);
    /// Move a gauge by `delta`: each worker adds its own part, so the gauge is the sum.
    fn add(&mut self, pool: usize, g: Gauge, delta: i64);
    fn histogram(&mut self, pool: usize, h: Histogram, ms: u64);
    /// A write to a stat of hold class `class` of pool `pool` (a host without class stats
    /// drops it).
    fn class(&mut self, _pool: usize, _class: usize, _stat: ClassStat, _write: Write) {}
}

/// What kind of stat a host defines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// The catalogue of stats every host defines: each counter, gauge and histogram of each pool,
/// with the host's id for it (None where the host refused one). Hosts differ only in how they
/// define a stat (a name per pool, or a family with a pool label) and how they write one.
pub struct Catalogue<Id> {
    ids: Vec<Option<Id>>,
    /// Per pool, per hold class, each `ClassStat` (empty without configured classes).
    class_ids: Vec<Option<Id>>,
    classes: usize,
}

const PER_POOL: usize = Counter::ALL.len() + Gauge::ALL.len() + Histogram::ALL.len();

impl<Id: Copy> Catalogue<Id> {
    /// `define(kind, pool name, stat name)` for every stat of every pool, in order.
    pub fn define<'p>(
        pools: impl IntoIterator<Item = &'p str>,
        mut define: impl FnMut(Kind, &str, &'static str) -> Option<Id>,
    ) -> Catalogue<Id> {
        let mut ids = Vec::new();
        for pool in pools {
            ids.extend(
                Counter::ALL
                    .iter()
                    .map(|c| define(Kind::Counter, pool, c.name())),
            );
            ids.extend(
                Gauge::ALL
                    .iter()
                    .map(|g| define(Kind::Gauge, pool, g.name())),
            );
            ids.extend(
                Histogram::ALL
                    .iter()
                    .map(|h| define(Kind::Histogram, pool, h.name())),
            );
        }
        Catalogue {
            ids,
            class_ids: Vec::new(),
            classes: 0,
        }
    }

    /// `define(kind, pool name, class name, stat)` for every stat of every hold class of every
    /// pool, in order. Hosts call it with the configured classes only (and the implicit
    /// `default` after them): without `hold.classes`, none.
    pub fn define_classes<'p>(
        mut self,
        pools: impl IntoIterator<Item = &'p str>,
        classes: &[&str],
        mut define: impl FnMut(Kind, &str, &str, ClassStat) -> Option<Id>,
    ) -> Catalogue<Id> {
        for pool in pools {
            for class in classes {
                for stat in ClassStat::ALL {
                    self.class_ids.push(define(stat.kind(), pool, class, stat));
                }
            }
        }
        self.classes = classes.len();
        self
    }

    pub fn class(&self, pool: usize, class: usize, stat: ClassStat) -> Option<Id> {
        if class >= self.classes {
            return None;
        }
        let at = (pool * self.classes + class) * ClassStat::ALL.len() + stat.index();
        self.class_ids.get(at).copied().flatten()
    }

    fn at(&self, pool: usize, offset: usize) -> Option<Id> {
        self.ids.get(pool * PER_POOL + offset).copied().flatten()
    }

    pub fn counter(&self, pool: usize, c: Counter) -> Option<Id> {
        self.at(pool, c.index())
    }

    pub fn gauge(&self, pool: usize, g: Gauge) -> Option<Id> {
        self.at(pool, Counter::ALL.len() + g.index())
    }

    pub fn histogram(&self, pool: usize, h: Histogram) -> Option<Id> {
        self.at(pool, Counter::ALL.len() + Gauge::ALL.len() + h.index())
    }
}

/// One write to a stat, as a host carries it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// A counter, by one.
    Count,
    /// A gauge set (last writer wins across workers).
    Set(u64),
    /// A gauge moved by this worker's part (the gauge is the sum over workers).
    Move(i64),
    /// A histogram sample.
    Record(u64),
}

/// How a host writes a stat of its catalogue (its id, and the pool it belongs to).
pub trait StatWriter<Id> {
    fn write(&mut self, pool: usize, id: Id, write: Write);
}

/// A host's catalogue and writer: the `Metrics` every host lends the core.
pub struct Sink<'a, Id, W> {
    pub catalogue: &'a Catalogue<Id>,
    pub writer: W,
}

impl<Id: Copy, W: StatWriter<Id>> Metrics for Sink<'_, Id, W> {
    fn count(&mut self, pool: usize, c: Counter) {
        if let Some(id) = self.catalogue.counter(pool, c) {
            self.writer.write(pool, id, Write::Count);
        }
    }

    fn gauge(&mut self, pool: usize, g: Gauge, value: u64) {
        if let Some(id) = self.catalogue.gauge(pool, g) {
            self.writer.write(pool, id, Write::Set(value));
        }
    }

    fn add(&mut self, pool: usize, g: Gauge, delta: i64) {
        if let Some(id) = self.catalogue.gauge(pool, g) {
            self.writer.write(pool, id, Write::Move(delta));
        }
    }

    fn histogram(&mut self, pool: usize, h: Histogram, ms: u64) {
        if let Some(id) = self.catalogue.histogram(pool, h) {
            self.writer.write(pool, id, Write::Record(ms));
        }
    }

    fn class(&mut self, pool: usize, class: usize, stat: ClassStat, write: Write) {
        if let Some(id) = self.catalogue.class(pool, class, stat) {
            self.writer.write(pool, id, write);
        }
    }
}

/// The values one worker last wrote to each gauge of each pool, so a write that repeats one is
/// skipped: most provider headers (limits, often remaining and reset too) repeat from one
/// response to the next, and each write is a hostcall. Another worker may have written a
/// different value in between; the gauge then shows that one until this worker sees a new
/// value, which is within last-writer-wins.
#[derive(Default)]
pub struct GaugeCache {
    written: Vec<[Option<u64>; Gauge::ALL.len()]>,
}

impl GaugeCache {
    /// `sink` with this cache in front of its gauge writes.
    pub fn over<'a>(&'a mut self, sink: &'a mut dyn Metrics) -> Cached<'a> {
        Cached { cache: self, sink }
    }
}

/// A metrics sink behind a `GaugeCache`.
pub struct Cached<'a> {
    cache: &'a mut GaugeCache,
    sink: &'a mut dyn Metrics,
}

impl Metrics for Cached<'_> {
    fn count(&mut self, pool: usize, c: Counter) {
        self.sink.count(pool, c);
    }

    fn gauge(&mut self, pool: usize, g: Gauge, value: u64) {
        let written = &mut self.cache.written;
        if written.len() <= pool {
            written.resize(pool + 1, [None; Gauge::ALL.len()]);
        }
        let last = &mut written[pool][g.index()];
        if *last != Some(value) {
            *last = Some(value);
            self.sink.gauge(pool, g, value);
        }
    }

    fn add(&mut self, pool: usize, g: Gauge, delta: i64) {
        self.sink.add(pool, g, delta);
    }

    fn histogram(&mut self, pool: usize, h: Histogram, ms: u64) {
        self.sink.histogram(pool, h, ms);
    }

    fn class(&mut self, pool: usize, class: usize, stat: ClassStat, write: Write) {
        self.sink.class(pool, class, stat, write);
    }
}

/// A recording sink for tests.
#[derive(Default, Debug)]
pub struct Recorded {
    pub counters: Vec<(usize, Counter)>,
    pub gauges: Vec<(usize, Gauge, u64)>,
    /// Sums of `add` per (pool, gauge).
    pub sums: Vec<(usize, Gauge, i64)>,
    pub histogram: Vec<(usize, u64)>,
    pub hold_ms: Vec<(usize, u64)>,
    pub fleet_call_ms: Vec<(usize, u64)>,
    /// `input_prediction_error_pct` and `output_prediction_error_pct`.
    pub prediction_error_pct: Vec<(usize, Histogram, u64)>,
    /// Writes to hold classes' stats: (pool, class, stat, write).
    pub classes: Vec<(usize, usize, ClassStat, Write)>,
}

impl Recorded {
    pub fn count_of(&self, pool: usize, c: Counter) -> usize {
        self.counters
            .iter()
            .filter(|(p, x)| *p == pool && *x == c)
            .count()
    }

    pub fn last_gauge(&self, pool: usize, g: Gauge) -> Option<u64> {
        self.gauges
            .iter()
            .rev()
            .find(|(p, x, _)| *p == pool && *x == g)
            .map(|(_, _, v)| *v)
    }

    /// Counts (or, for the gauge, the sum of moves) of a hold class's stat.
    pub fn class_total(&self, pool: usize, class: usize, stat: ClassStat) -> i64 {
        let mine = self
            .classes
            .iter()
            .filter(|(p, c, s, _)| (*p, *c, *s) == (pool, class, stat));
        mine.map(|(_, _, _, w)| match w {
            Write::Move(d) => *d,
            _ => 1,
        })
        .sum()
    }

    pub fn sum(&self, pool: usize, g: Gauge) -> i64 {
        self.sums
            .iter()
            .filter(|(p, x, _)| *p == pool && *x == g)
            .map(|(_, _, v)| *v)
            .sum()
    }
}

impl Metrics for Recorded {
    fn count(&mut self, pool: usize, c: Counter) {
        self.counters.push((pool, c));
    }
    fn gauge(&mut self, pool: usize, g: Gauge, value: u64) {
        self.gauges.push((pool, g, value));
    }
    fn add(&mut self, pool: usize, g: Gauge, delta: i64) {
        self.sums.push((pool, g, delta));
    }
    fn histogram(&mut self, pool: usize, h: Histogram, ms: u64) {
        match h {
            Histogram::RetryAfterMs => self.histogram.push((pool, ms)),
            Histogram::HoldMs => self.hold_ms.push((pool, ms)),
            Histogram::FleetCallMs => self.fleet_call_ms.push((pool, ms)),
            Histogram::InputPredictionErrorPct | Histogram::OutputPredictionErrorPct => {
                self.prediction_error_pct.push((pool, h, ms))
            }
        }
    }
    fn class(&mut self, pool: usize, class: usize, stat: ClassStat, write: Write) {
        self.classes.push((pool, class, stat, write));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_catalogue_finds_each_stat_of_each_pool() {
        let mut defined = Vec::new();
        let cat = Catalogue::define(["a", "b"], |kind, pool, name| {
            defined.push((kind, pool.to_string(), name.to_string()));
            (name != "hold_ms").then_some(defined.len())
        });
        assert_eq!(defined.len(), 2 * PER_POOL);
        let id = cat.counter(1, Counter::Held).unwrap();
        assert_eq!(defined[id - 1], (Kind::Counter, "b".into(), "held".into()));
        let id = cat.gauge(0, Gauge::InFlight).unwrap();
        assert_eq!(
            defined[id - 1],
            (Kind::Gauge, "a".into(), Gauge::InFlight.name().into())
        );
        let id = cat.histogram(1, Histogram::RetryAfterMs).unwrap();
        assert_eq!(defined[id - 1].2, "retry_after_ms");
        assert_eq!(
            cat.histogram(0, Histogram::HoldMs),
            None,
            "refused by the host"
        );
        assert_eq!(cat.counter(2, Counter::Held), None, "no such pool");
    }

    #[test]
    fn every_stat_has_a_family_and_labels_split_the_names_wasm_folds() {
        let names = Counter::ALL
            .iter()
            .map(|c| c.name())
            .chain(Gauge::ALL.iter().map(|g| g.name()))
            .chain(Histogram::ALL.iter().map(|h| h.name()));
        for name in names {
            let f = Family::of(name);
            assert_ne!(f.name, "llm_governor.unknown", "{name}");
            let rebuilt = match f.label {
                Some((_, value)) => {
                    format!("{}_{value}", f.name.trim_start_matches("llm_governor."))
                }
                None => f.name.trim_start_matches("llm_governor.").to_string(),
            };
            assert_eq!(rebuilt, name);
        }
        assert_eq!(
            Family::of("upstream_quota_exhausted"),
            Family {
                name: "llm_governor.upstream",
                label: Some(("class", "quota_exhausted"))
            }
        );
        assert_eq!(
            Family::of("local_reject_limit").label,
            Some(("reason", "limit"))
        );
    }
}
