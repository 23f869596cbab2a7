//! Properties of the pure core, checked on generated inputs (proptest): what clients are told,
//! how cooldowns merge, what a bucket and the key budget admit under racing workers, and how
//! usage is read from a chunked stream.
//!
//! Runs are deterministic (a fixed seed) unless `PROPTEST_RNG_SEED` is set; `PROPTEST_CASES`
//! scales every property. Racing workers are real threads, but only one of them touches the
//! store at a time, in an order the test generates (`Interleaving`), so a failing schedule
//! shrinks and replays like any other input.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{header, Decision, FixedRng, Host, T0};
use llm_governor_core::classify::Class;
use llm_governor_core::config::{self, RetryAfter};
use llm_governor_core::cooldown::{self, CooldownRecord, Wanted};
use llm_governor_core::headers::{owned, Headers};
use llm_governor_core::keys;
use llm_governor_core::metrics::{Counter, Recorded};
use llm_governor_core::policy::{Governor, RequestView};
use llm_governor_core::retry_after;
use llm_governor_core::store::{MemStore, SharedStore, StoreError};
use llm_governor_core::time::MAX_PARSED_MS;
use llm_governor_core::usage::UsageScanner;
use llm_governor_core::worker::{Action, Lent, NoBodies, Worker};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use std::sync::Arc;
use std::sync::{Condvar, Mutex};

/// `cases` per property, a fixed seed unless the environment picks one, and no regression
/// files written next to the tests (a fixed seed replays a failure anyway).
fn config(cases: u32) -> Config {
    let base = Config::default();
    let seeded = std::env::var_os("PROPTEST_RNG_SEED").is_some();
    Config {
        cases: if std::env::var_os("PROPTEST_CASES").is_some() {
            base.cases
        } else {
            cases
        },
        rng_seed: if seeded {
            base.rng_seed
        } else {
            RngSeed::Fixed(0x6c6c_6d67)
        },
        failure_persistence: None,
        ..base
    }
}

const RL_BODY: &str = r#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on requests per min (RPM): Limit 500, Used 500, Requested 1.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;

/// Randomness as the host would draw it, and values it never should (NaN, negative, > 1).
fn rng_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 0.0..1.0f64,
        1 => Just(0.999_999_999),
        1 => proptest::num::f64::ANY,
    ]
}

/// A `retry_after` section that `config::parse` accepts.
fn retry_after_cfg() -> impl Strategy<Value = RetryAfter> {
    (
        prop_oneof![1..=120_000u64, 1..=604_800_000u64],
        0.0..=1.0f64,
        any::<bool>(),
    )
        .prop_flat_map(|(max_ms, jitter, escalate)| {
            (1..=max_ms).prop_map(move |default_ms| RetryAfter {
                default_ms,
                max_ms,
                jitter,
                escalate,
            })
        })
}

/// How a provider states its delay.
#[derive(Clone, Debug)]
enum Hint {
    Ms(u64),
    Seconds(u64),
    /// Both: `retry-after-ms` wins.
    Both {
        ms: u64,
        seconds: u64,
    },
}

impl Hint {
    fn headers(&self) -> Vec<(String, String)> {
        match *self {
            Hint::Ms(ms) => vec![("retry-after-ms".into(), ms.to_string())],
            Hint::Seconds(s) => vec![("retry-after".into(), s.to_string())],
            Hint::Both { ms, seconds } => vec![
                ("retry-after".into(), seconds.to_string()),
                ("retry-after-ms".into(), ms.to_string()),
            ],
        }
    }

    /// The provider's time in ms, as the contract reads it (capped at one year).
    fn provider_ms(&self) -> u64 {
        match *self {
            Hint::Ms(ms) | Hint::Both { ms, .. } => ms,
            Hint::Seconds(s) => s.saturating_mul(1000),
        }
        .min(MAX_PARSED_MS)
    }
}

fn hint() -> impl Strategy<Value = Hint> {
    let ms = prop_oneof![1..=2_000u64, 1..=600_000u64, 1..=u64::MAX];
    let seconds = prop_oneof![1..=60u64, 1..=100_000u64, 1..=u64::MAX / 1000];
    prop_oneof![
        ms.clone().prop_map(Hint::Ms),
        seconds.clone().prop_map(Hint::Seconds),
        (ms, seconds).prop_map(|(ms, seconds)| Hint::Both { ms, seconds }),
    ]
}

proptest! {
    #![proptest_config(config(512))]

    /// (a) The delay a client is told is never below the provider's (up to the cap), whatever
    /// the jitter config and whatever the randomness returns.
    #[test]
    fn told_is_never_less_than_the_provider_time(
        provider_ms in prop_oneof![0..=10_000u64, any::<u64>()],
        spread_ms in prop_oneof![0..=10_000u64, any::<u64>()],
        cfg in retry_after_cfg(),
        u in rng_value(),
    ) {
        let told = retry_after::told(provider_ms, spread_ms, &cfg, &mut FixedRng::new(u));
        prop_assert!(told >= provider_ms.min(cfg.max_ms).max(1), "told {told}");
        prop_assert!(told <= cfg.max_ms, "told {told} above max_ms {}", cfg.max_ms);
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// (a) The same, end to end: a 429/503/529 carrying the hint is rewritten to at least the
    /// provider's time in both header forms, and so is every local answer while the cooldown
    /// it started runs.
    #[test]
    fn governed_headers_never_say_less_than_the_provider(
        hint in hint(),
        cfg in retry_after_cfg(),
        status in prop_oneof![Just(429u16), Just(503), Just(529)],
        u in rng_value(),
        later in 0.0..1.0f64,
    ) {
        let json = format!(
            r#"{{"retry_after": {{"default_ms": {}, "max_ms": {}, "jitter": {}, "escalate": {}}},
                 "cooldown": {{"max_ms": 604800000}}}}"#,
            cfg.default_ms, cfg.max_ms, cfg.jitter, cfg.escalate
        );
        let mut host = Host::new(&json);
        host.rng.set(u);
        let provider = hint.provider_ms();
        let floor = provider.min(cfg.max_ms);
        let hs = hint.headers();
        let hs: Vec<(&str, &str)> = hs.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let flow = host.forward("/v1/chat/completions", &[("authorization", "Bearer sk-p")]);
        let body = if status == 429 { RL_BODY } else { "" };
        let g = host.respond(&flow, status, &hs, body);
        let g = g.unwrap_or_else(|| panic!("{status} not governed"));
        prop_assert_eq!(g.provider_ms, Some(provider));
        prop_assert!(g.delay_ms >= floor, "told {} < {floor}", g.delay_ms);
        let ms: u64 = header(&g.headers, "retry-after-ms").parse().unwrap();
        let secs: u64 = header(&g.headers, "retry-after").parse().unwrap();
        prop_assert_eq!(ms, g.delay_ms);
        prop_assert!(secs.saturating_mul(1000) >= floor, "retry-after {secs} s < {floor} ms");

        // Later in the cooldown (it lasts the provider's time, at most cooldown.max_ms).
        let cooling = provider.min(604_800_000);
        let elapsed = ((cooling as f64) * later) as u64;
        host.advance(elapsed);
        let left = cooling - elapsed;
        match host.request("/v1/chat/completions", &[("authorization", "Bearer sk-p")]) {
            Decision::Reply(r) => {
                let ms: u64 = header(&r.headers, "retry-after-ms").parse().unwrap();
                let secs: u64 = header(&r.headers, "retry-after").parse().unwrap();
                let floor = left.min(cfg.max_ms);
                prop_assert!(ms >= floor, "local answer {ms} < {floor} ms left");
                prop_assert!(secs.saturating_mul(1000) >= floor);
            }
            Decision::Forward(_) => {
                prop_assert_eq!(left, 0, "forwarded with {} ms of cooldown left", left);
            }
        }
    }
}

/// One answer of the provider, as the policy merges it: `after_ms` after the previous one,
/// a cooldown of `ms` of `class` (None: an answer that gave no time).
#[derive(Clone, Debug)]
struct Answer {
    after_ms: u64,
    wanted: Option<(Class, u64)>,
    streak: u8,
}

fn class() -> impl Strategy<Value = Class> {
    prop_oneof![
        Just(Class::RateLimited),
        Just(Class::QuotaExhausted),
        Just(Class::Overloaded)
    ]
}

fn answers() -> impl Strategy<Value = Vec<Answer>> {
    // Few distinct periods, so that bursts repeating one statement are common.
    let ms = prop_oneof![
        4 => prop::sample::select(vec![0u64, 1, 250, 999, 1000, 2000, 60_000]),
        2 => 0..=120_000u64,
        1 => Just(u64::from(u32::MAX) + 7),
    ];
    let answer = (
        prop_oneof![3 => 0..=300u64, 1 => 0..=150_000u64],
        prop::option::weighted(0.85, (class(), ms)),
        any::<u8>(),
    )
        .prop_map(|(after_ms, wanted, streak)| Answer {
            after_ms,
            wanted,
            streak,
        });
    prop::collection::vec(answer, 1..24)
}

proptest! {
    #![proptest_config(config(512))]

    /// (b) A merged cooldown never ends before an answer's deadline, except as `merge`
    /// documents: an answer repeating the running cooldown's statement (same class, same
    /// period, the cooldown still running) whose deadline lies within `period * jitter` of it
    /// keeps the earlier deadline. The deadline never moves earlier, and an answer with no time
    /// leaves it as it was.
    #[test]
    fn cooldown_merge_never_ends_before_the_provider_deadline(
        start in prop_oneof![Just(0u64), Just(T0), any::<u64>()],
        answers in answers(),
        jitter in prop_oneof![Just(0.0), Just(0.2), Just(1.0), 0.0..=1.0f64],
    ) {
        let mut rec: Option<CooldownRecord> = None;
        let mut now = start;
        // Every deadline an answer asked for, and how much earlier the band lets the
        // record's deadline be (0 when the answer did not repeat the running statement).
        let mut asked: Vec<(u64, f64)> = Vec::new();
        for a in &answers {
            now = now.saturating_add(a.after_ms);
            let wanted = a.wanted.map(|(class, ms)| Wanted { class, ms });
            let next = cooldown::merge(rec, wanted, a.streak, now, jitter);
            let before = rec.map_or(0, |r| r.deadline_ms);
            prop_assert!(next.deadline_ms >= before, "deadline moved earlier");
            prop_assert_eq!(next.streak, a.streak);
            match wanted {
                None => prop_assert_eq!(next.deadline_ms, before),
                Some(w) => {
                    let period = u32::try_from(w.ms).unwrap_or(u32::MAX);
                    let repeats = rec.is_some_and(|r| {
                        r.deadline_ms > now && r.class == w.class && r.period_ms == period
                    });
                    let band = if repeats { f64::from(period) * jitter } else { 0.0 };
                    asked.push((now.saturating_add(w.ms), band));
                }
            }
            for (deadline, band) in &asked {
                if next.deadline_ms < *deadline {
                    prop_assert!(
                        (*deadline - next.deadline_ms) as f64 <= *band,
                        "deadline {} ends {} ms before an answer's {deadline} (band {band})",
                        next.deadline_ms,
                        deadline - next.deadline_ms
                    );
                }
            }
            rec = Some(next);
        }
    }
}

/// Who may touch the store next. Each worker thread waits for its turn before every store
/// operation, and passes the turn on after it to the worker the generated picks name (among
/// those still running): every interleaving of whole store operations can be generated, and
/// CAS conflicts are the real ones those interleavings produce.
struct Interleaving {
    state: Mutex<Turns>,
    changed: Condvar,
}

struct Turns {
    turn: Option<usize>,
    picks: Vec<u8>,
    next: usize,
    running: Vec<bool>,
    /// A worker that gets no turn while any other worker still runs.
    starved: Option<usize>,
}

impl Turns {
    fn pass(&mut self) {
        let running: Vec<usize> = (0..self.running.len())
            .filter(|w| self.running[*w])
            .collect();
        let fed: Vec<usize> = running
            .iter()
            .copied()
            .filter(|w| Some(*w) != self.starved)
            .collect();
        let choice = if fed.is_empty() { running } else { fed };
        self.turn = (!choice.is_empty()).then(|| {
            let pick = usize::from(self.picks[self.next % self.picks.len()]);
            self.next += 1;
            choice[pick % choice.len()]
        });
    }
}

impl Interleaving {
    fn new(workers: usize, picks: Vec<u8>) -> Interleaving {
        let mut turns = Turns {
            turn: None,
            picks,
            next: 0,
            running: vec![true; workers],
            starved: None,
        };
        turns.pass();
        Interleaving {
            state: Mutex::new(turns),
            changed: Condvar::new(),
        }
    }

    /// Run `op` in `me`'s turn; when it says so, `me` is starved from then on.
    fn step<T>(&self, me: usize, op: impl FnOnce() -> (T, bool)) -> T {
        let mut s = self.state.lock().unwrap();
        while s.turn != Some(me) {
            s = self.changed.wait(s).unwrap();
        }
        let (out, starve) = op();
        if starve {
            s.starved = Some(me);
        }
        s.pass();
        self.changed.notify_all();
        out
    }

    fn done(&self, me: usize) {
        let mut s = self.state.lock().unwrap();
        s.running[me] = false;
        if s.turn == Some(me) || s.turn.is_none() {
            s.pass();
        }
        self.changed.notify_all();
    }
}

/// One worker's view of the shared store: every operation waits for its turn.
struct WorkerStore<'a> {
    store: &'a MemStore,
    order: &'a Interleaving,
    me: usize,
    /// Deschedule this worker right before its unconditional write of a key with this prefix
    /// (a creator's first write, after it found the key missing), until every other worker is
    /// done: the widest first-write race Envoy's shared data allows.
    starve_before_blind_write: Option<&'a str>,
    /// Every key written unconditionally (a creator's first write), in order.
    blind_writes: &'a Mutex<Vec<String>>,
}

impl SharedStore for WorkerStore<'_> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.order.step(self.me, || (self.store.get(key), false))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let blind = cas.is_none()
            && self
                .starve_before_blind_write
                .is_some_and(|p| key.starts_with(p));
        if blind {
            self.order.step(self.me, || ((), true));
        }
        self.order.step(self.me, || {
            if cas.is_none() {
                self.blind_writes.lock().unwrap().push(key.to_string());
            }
            (self.store.set(key, value, cas), false)
        })
    }
}

/// What a set of workers did: requests forwarded, updates given up under contention (each
/// of which admits, fail-open), and the keys written unconditionally.
#[derive(Debug, Default)]
struct Outcome {
    forwarded: usize,
    contended: usize,
    blind_writes: Vec<String>,
}

impl Outcome {
    /// How many workers wrote a key starting with `prefix` as its creator.
    fn creators(&self, prefix: &str) -> u64 {
        self.blind_writes
            .iter()
            .filter(|k| k.starts_with(prefix))
            .count() as u64
    }
}

/// Worker `w` sends `requests[w]` (tenant id, time) one after another through
/// `Governor::on_request`, all workers at once, store operations in the order `picks` says;
/// worker 0 is descheduled before its first write of a key starting with `starve`.
fn race(
    governor: &Arc<Governor>,
    store: &MemStore,
    requests: &[Vec<(String, u64)>],
    picks: Vec<u8>,
    starve: Option<&str>,
) -> Outcome {
    let order = Interleaving::new(requests.len(), picks);
    let blind_writes = Mutex::new(Vec::new());
    let outcomes: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .enumerate()
            .map(|(me, mine)| {
                let order = &order;
                let blind_writes = &blind_writes;
                s.spawn(move || {
                    let store = WorkerStore {
                        store,
                        order,
                        me,
                        starve_before_blind_write: starve.filter(|_| me == 0),
                        blind_writes,
                    };
                    let mut metrics = Recorded::default();
                    let mut worker =
                        Worker::with_random(Arc::clone(governor), Box::new(FixedRng::new(0.5)));
                    let mut forwarded = 0;
                    for (id, (tenant, now_ms)) in (1..).zip(mine) {
                        let hs = owned(&[("x-tenant-id", tenant)]);
                        let view = RequestView {
                            path: b"/v1/chat/completions",
                            authority: b"api.example.com",
                            headers: Headers::new(&hs),
                        };
                        let now = *now_ms;
                        let mut lent = Lent {
                            store: &store,
                            metrics: &mut metrics,
                            clock: &move || now,
                            io: &mut NoBodies,
                        };
                        let r = worker.on_request_headers(id, &view, true, &mut lent);
                        if r.action == Action::Continue {
                            forwarded += 1;
                        }
                    }
                    order.done(me);
                    Outcome {
                        forwarded,
                        contended: metrics.count_of(0, Counter::StoreContention),
                        blind_writes: Vec::new(),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    Outcome {
        forwarded: outcomes.iter().map(|o| o.forwarded).sum(),
        contended: outcomes.iter().map(|o| o.contended).sum(),
        blind_writes: blind_writes.into_inner().unwrap(),
    }
}

fn governor(json: &str) -> Arc<Governor> {
    Arc::new(Governor::new(
        config::parse(json.as_bytes()).unwrap(),
        keys::HashKey::from_words(1, 2),
    ))
}

/// Store operations in any order: mostly random, sometimes one worker starved for long runs.
fn picks() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => prop::collection::vec(any::<u8>(), 1..64),
        1 => prop::collection::vec(prop_oneof![5 => Just(1u8), 1 => Just(0u8)], 1..64),
    ]
}

/// A bucket's arithmetic over the racing workers' requests.
#[derive(Clone, Debug)]
struct BucketRace {
    per_minute: u64,
    burst: u64,
    /// Per worker, the times (ms after T0) of its requests after the first.
    later: Vec<Vec<u64>>,
    first: Vec<u8>,
    rest: Vec<u8>,
    /// Worker 0's first write of the new bucket comes after every other first request.
    starve: bool,
}

fn bucket_race() -> impl Strategy<Value = BucketRace> {
    (
        prop_oneof![Just(1u64), 1..=600u64],
        1..=8u64,
        prop::collection::vec(prop::collection::vec(0..=400u64, 0..8), 2..=4),
        picks(),
        picks(),
        any::<bool>(),
    )
        .prop_map(|(per_minute, burst, mut later, first, rest, starve)| {
            for times in &mut later {
                times.sort_unstable();
            }
            BucketRace {
                per_minute,
                burst,
                later,
                first,
                rest,
                starve,
            }
        })
}

proptest! {
    #![proptest_config(config(96))]

    /// (c) One tenant's bucket, created by the racing workers' first requests (no
    /// insert-if-absent: a racing creator's initial write can erase takes), then drained by
    /// their later requests, all through `on_request` with the production write pattern
    /// (admissions and refill timestamps). It never admits more than
    /// `burst + refill + workers - 1`, plus one per update given up under contention (those
    /// admit fail-open and count `store_contention`); with a single creator, not even the
    /// `workers - 1`.
    #[test]
    fn a_bucket_never_admits_more_than_burst_plus_workers_minus_one(race_in in bucket_race()) {
        let BucketRace { per_minute, burst, later, first, rest, starve } = race_in;
        let g = governor(&format!(
            r#"{{"limits": [{{"name": "rpm", "key": "header:x-tenant-id",
                 "requests_per_minute": {per_minute}, "burst": {burst}}}]}}"#
        ));
        let store = MemStore::new();
        let workers = later.len();
        // Every worker's first request for the new tenant at once, then the later ones.
        let firsts: Vec<Vec<(String, u64)>> = vec![vec![("t".to_string(), T0)]; workers];
        let a = race(&g, &store, &firsts, first, starve.then_some("b:"));
        let rest_requests: Vec<Vec<(String, u64)>> = later
            .iter()
            .map(|times| times.iter().map(|t| ("t".to_string(), T0 + t)).collect())
            .collect();
        let b = race(&g, &store, &rest_requests, rest, None);
        let last = later.iter().flatten().copied().max().unwrap_or(0);
        // Whole tokens the bucket gains over the run (it starts full at T0).
        let refill = per_minute * last / 60_000;
        let forwarded = a.forwarded as u64 + b.forwarded as u64;
        let contended = (a.contended + b.contended) as u64;
        let creators = a.creators("b:") + b.creators("b:");
        let erased = if creators > 1 { workers as u64 - 1 } else { 0 };
        prop_assert!(
            forwarded <= burst + refill + erased + contended,
            "{forwarded} admitted > burst {burst} + refill {refill} + {erased} erased \
             ({creators} creators, {workers} workers) + {contended} contended"
        );
    }
}

/// The key budget over racing workers that each bring new tenants.
#[derive(Clone, Debug)]
struct KeyRace {
    max_keys: u64,
    /// Per worker, how many distinct tenants it sends after its first.
    later: Vec<usize>,
    first: Vec<u8>,
    rest: Vec<u8>,
    /// Worker 0's first write of the key count comes after every other first request.
    starve: bool,
}

fn key_race() -> impl Strategy<Value = KeyRace> {
    (
        1..=6u64,
        prop::collection::vec(0..=8usize, 2..=4),
        picks(),
        picks(),
        any::<bool>(),
    )
        .prop_map(|(max_keys, later, first, rest, starve)| KeyRace {
            max_keys,
            later,
            first,
            rest,
            starve,
        })
}

proptest! {
    #![proptest_config(config(96))]

    /// (e) Many distinct tenants against a small `max_keys`: the distinct bucket keys in the
    /// store (the shared overflow key aside) never exceed `max_keys` by more than the racing
    /// workers. Racing creators of the key count can each erase increments (no
    /// insert-if-absent) and a contended count admits, so the bound is
    /// `max_keys + workers - 1 + contended`, and `max_keys + contended` with a single creator.
    #[test]
    fn max_keys_is_exceeded_by_at_most_the_racing_workers(race_in in key_race()) {
        let KeyRace { max_keys, later, first, rest, starve } = race_in;
        let g = governor(&format!(
            r#"{{"max_keys": {max_keys}, "limits": [{{"name": "t", "key": "header:x-tenant-id",
                 "requests_per_minute": 60}}]}}"#
        ));
        let store = MemStore::new();
        let workers = later.len();
        let firsts: Vec<Vec<(String, u64)>> =
            (0..workers).map(|w| vec![(format!("w{w}-0"), T0)]).collect();
        let a = race(&g, &store, &firsts, first, starve.then_some("k:"));
        let rest_requests: Vec<Vec<(String, u64)>> = later
            .iter()
            .enumerate()
            .map(|(w, n)| (1..=*n).map(|i| (format!("w{w}-{i}"), T0 + i as u64)).collect())
            .collect();
        let b = race(&g, &store, &rest_requests, rest, None);
        let keys = bucket_keys(&store);
        let contended = (a.contended + b.contended) as u64;
        prop_assert!(
            keys <= max_keys + workers as u64,
            "{keys} bucket keys > max_keys {max_keys} + {workers} workers"
        );
        let creators = a.creators(keys::BUCKET_KEY_COUNT) + b.creators(keys::BUCKET_KEY_COUNT);
        let erased = if creators > 1 { workers as u64 - 1 } else { 0 };
        prop_assert!(
            keys <= max_keys + erased + contended,
            "{keys} bucket keys > max_keys {max_keys} + {erased} erased ({creators} creators, \
             {workers} workers) + {contended} contended"
        );
    }
}

/// Any interleaving at all: a worker's first request may race with other workers' later
/// ones, and worker 0 may be descheduled right before its first blind write.
#[derive(Clone, Debug)]
struct FreeRace {
    /// Per worker, the times (ms after T0) of its requests after the first (at T0).
    later: Vec<Vec<u64>>,
    picks: Vec<u8>,
    starve: bool,
}

fn free_race() -> impl Strategy<Value = FreeRace> {
    (
        prop::collection::vec(prop::collection::vec(0..=400u64, 0..8), 2..=4),
        picks(),
        any::<bool>(),
    )
        .prop_map(|(mut later, picks, starve)| {
            for times in &mut later {
                times.sort_unstable();
            }
            FreeRace {
                later,
                picks,
                starve,
            }
        })
}

proptest! {
    #![proptest_config(config(64))]

    /// (c) Under any interleaving, each racing creator can reset a new bucket to full once,
    /// so a bucket admits at most `creators * (burst + refill)` (creators <= workers), plus
    /// one per update given up under contention. (`burst + workers - 1` needs the first requests to race only each
    /// other; see `a_creator_descheduled_before_its_first_write_erases_one_take_at_most`.)
    #[test]
    fn under_any_interleaving_a_bucket_admits_at_most_one_burst_per_worker(
        race_in in free_race(),
        per_minute in prop_oneof![Just(1u64), 1..=600u64],
        burst in 1..=6u64,
    ) {
        let FreeRace { later, picks, starve } = race_in;
        let g = governor(&format!(
            r#"{{"limits": [{{"name": "rpm", "key": "header:x-tenant-id",
                 "requests_per_minute": {per_minute}, "burst": {burst}}}]}}"#
        ));
        let store = MemStore::new();
        let workers = later.len() as u64;
        let requests: Vec<Vec<(String, u64)>> = later
            .iter()
            .map(|times| {
                std::iter::once(T0)
                    .chain(times.iter().map(|t| T0 + t))
                    .map(|t| ("t".to_string(), t))
                    .collect()
            })
            .collect();
        let o = race(&g, &store, &requests, picks, starve.then_some("b:"));
        let last = later.iter().flatten().copied().max().unwrap_or(0);
        let refill = per_minute * last / 60_000;
        let creators = o.creators("b:");
        prop_assert!((1..=workers).contains(&creators), "{creators} creators");
        let bound = creators * (burst + refill) + o.contended as u64;
        prop_assert!(
            o.forwarded as u64 <= bound,
            "{} admitted > {creators} creators * (burst {burst} + refill {refill}) + {} contended",
            o.forwarded,
            o.contended
        );
    }

    /// (e) Under any interleaving, each racing creator of the key count can reset it once, so
    /// distinct bucket keys stay within `creators * max_keys` (creators <= workers), plus one
    /// per contended count.
    /// (`max_keys + workers - 1` needs the first requests to race only each other; see
    /// `a_key_count_creator_descheduled_before_its_first_write_erases_one_count_at_most`.)
    #[test]
    fn under_any_interleaving_keys_stay_within_max_keys_per_worker(
        race_in in free_race(),
        max_keys in 1..=6u64,
    ) {
        let FreeRace { later, picks, starve } = race_in;
        let g = governor(&format!(
            r#"{{"max_keys": {max_keys}, "limits": [{{"name": "t", "key": "header:x-tenant-id",
                 "requests_per_minute": 60}}]}}"#
        ));
        let store = MemStore::new();
        let workers = later.len() as u64;
        let requests: Vec<Vec<(String, u64)>> = later
            .iter()
            .enumerate()
            .map(|(w, times)| {
                (0..=times.len())
                    .map(|i| (format!("w{w}-{i}"), T0 + i as u64))
                    .collect()
            })
            .collect();
        let o = race(&g, &store, &requests, picks, starve.then_some("k:"));
        let keys = bucket_keys(&store);
        let creators = o.creators(keys::BUCKET_KEY_COUNT);
        prop_assert!((1..=workers).contains(&creators), "{creators} creators");
        prop_assert!(
            keys <= creators * max_keys + o.contended as u64,
            "{keys} bucket keys > {creators} creators * max_keys {max_keys} + {} contended",
            o.contended
        );
    }
}

/// Distinct per-tenant bucket keys in the store (the shared overflow key aside).
fn bucket_keys(store: &MemStore) -> u64 {
    store
        .dump()
        .into_iter()
        .filter(|(k, _)| k.starts_with("b:") && !k.ends_with(":~"))
        .count() as u64
}

/// Known limit, found by the interleavings above: with no insert-if-absent, a worker
/// descheduled between finding a new bucket missing and writing its initial (full) value
/// erases every take the other workers made meanwhile, not only the one that raced it
/// (`store::update` documents the latter). Here one worker takes the whole burst while the
/// other waits to write: 2 bursts are admitted. Ignored until the store protocol bounds it;
/// `cargo test --test properties -- --ignored` shows it.
#[test]
#[ignore = "known limit: a descheduled creator's first write erases every take made meanwhile"]
fn a_creator_descheduled_before_its_first_write_erases_one_take_at_most() {
    let (burst, workers) = (5, 2);
    let g = governor(&format!(
        r#"{{"limits": [{{"name": "rpm", "key": "header:x-tenant-id",
             "requests_per_minute": 1, "burst": {burst}}}]}}"#
    ));
    let store = MemStore::new();
    let requests = vec![vec![("t".to_string(), T0); 10]; workers];
    let o = race(&g, &store, &requests, vec![0], Some("b:"));
    let documented = burst + workers - 1;
    assert!(
        o.forwarded <= documented,
        "{} admitted > burst {burst} + {workers} workers - 1 ({o:?})",
        o.forwarded
    );
}

/// The same for the key count: a worker descheduled before its first write of `k:b` resets
/// the count the others built meanwhile, so `max_keys` is exceeded by more than the racing
/// workers (`Governor::admit_new_key` documents at most that many).
#[test]
#[ignore = "known limit: a descheduled creator of the key count resets it"]
fn a_key_count_creator_descheduled_before_its_first_write_erases_one_count_at_most() {
    let (max_keys, workers) = (3, 2);
    let g = governor(&format!(
        r#"{{"max_keys": {max_keys}, "limits": [{{"name": "t", "key": "header:x-tenant-id",
             "requests_per_minute": 60}}]}}"#
    ));
    let store = MemStore::new();
    let requests: Vec<Vec<(String, u64)>> = (0..workers)
        .map(|w| (0..4).map(|i| (format!("w{w}-{i}"), T0)).collect())
        .collect();
    let o = race(&g, &store, &requests, vec![0], Some("k:"));
    let keys = bucket_keys(&store);
    assert!(
        keys <= max_keys + workers as u64,
        "{keys} bucket keys > max_keys {max_keys} + {workers} workers ({o:?})"
    );
}

/// A response body in one of the shapes providers send, with the total a scanner must read.
fn usage_body() -> impl Strategy<Value = (Vec<u8>, u64)> {
    let n = || prop_oneof![4 => 0..=100_000u64, 1 => 0..=u64::from(u32::MAX), 1 => Just(u64::MAX)];
    // JSON-escaped model text, sometimes quoting usage-like JSON itself.
    let text = prop_oneof![
        3 => "[a-zA-Z0-9 .,:;{}()\\[\\]-]{0,60}",
        1 => Just(r#"{\"total_tokens\": 5, \"input_tokens\":9}"#.to_string()),
        1 => Just(r#"usage \"promptTokenCount\":\n 12"#.to_string()),
    ];
    let sep = prop::sample::select(vec![":", ": ", " : ", ":\n  "]);
    prop_oneof![
        // OpenAI chat completion.
        (n(), n(), n(), n(), text.clone(), sep.clone()).prop_map(|(p, c, t, k, text, s)| {
            let b = format!(
                r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens"{s}{p},"completion_tokens"{s}{c},"total_tokens"{s}{t},"prompt_tokens_details":{{"cached_tokens":{k}}}}}}}"#
            );
            (b.into_bytes(), t)
        }),
        // OpenAI stream: deltas, then the usage chunk.
        (prop::collection::vec(text.clone(), 0..6), n(), n(), n(), sep.clone()).prop_map(
            |(deltas, p, c, t, s)| {
                let mut b = String::new();
                for d in deltas {
                    b += &format!(
                        "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"delta\":{{\"content\":\"{d}\"}}}}],\"usage\":null}}\n\n"
                    );
                }
                b += &format!(
                    "data: {{\"id\":\"c\",\"choices\":[],\"usage\":{{\"prompt_tokens\"{s}{p},\"completion_tokens\"{s}{c},\"total_tokens\"{s}{t}}}}}\n\ndata: [DONE]\n\n"
                );
                (b.into_bytes(), t)
            }
        ),
        // Anthropic message: input, cache writes and output (cache reads do not count).
        (n(), n(), n(), n(), text.clone(), sep.clone()).prop_map(|(i, w, r, o, text, s)| {
            let b = format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","content":[{{"type":"text","text":"{text}"}}],"usage":{{"input_tokens"{s}{i},"cache_creation_input_tokens"{s}{w},"cache_read_input_tokens"{s}{r},"output_tokens"{s}{o}}}}}"#
            );
            (b.into_bytes(), i.saturating_add(o).saturating_add(w))
        }),
        // Anthropic stream: message_start, deltas, message_delta with the final output count.
        (n(), n(), prop::collection::vec(text.clone(), 0..6), n(), sep.clone()).prop_map(
            |(i, first_out, deltas, o, s)| {
                let mut b = format!(
                    "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"msg_1\",\"usage\":{{\"input_tokens\"{s}{i},\"output_tokens\"{s}{first_out}}}}}}}\n\n"
                );
                for d in deltas {
                    b += &format!(
                        "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"delta\":{{\"type\":\"text_delta\",\"text\":\"{d}\"}}}}\n\n"
                    );
                }
                b += &format!(
                    "event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\"}},\"usage\":{{\"output_tokens\"{s}{o}}}}}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
                );
                (b.into_bytes(), i.saturating_add(o))
            }
        ),
        // Gemini, whole or streamed with running totals (the last one counts).
        (prop::collection::vec((n(), n(), n(), text), 1..5), sep).prop_map(|(chunks, s)| {
            let mut b = String::new();
            let mut last = 0;
            for (p, c, t, text) in chunks {
                b += &format!(
                    "data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"{text}\"}}],\"role\":\"model\"}}}}],\"usageMetadata\":{{\"promptTokenCount\"{s}{p},\"candidatesTokenCount\"{s}{c},\"totalTokenCount\"{s}{t}}}}}\r\n\r\n"
                );
                last = t;
            }
            (b.into_bytes(), last)
        }),
    ]
}

proptest! {
    #![proptest_config(config(384))]

    /// (d) The usage total does not depend on how the body is chunked, and is the one the
    /// provider reported.
    #[test]
    fn usage_total_does_not_depend_on_chunking(
        (body, total) in usage_body(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(body.len() + 1)).collect();
        at.sort_unstable();
        let mut scanner = UsageScanner::new();
        let mut from = 0;
        for to in at.iter().copied().chain([body.len()]) {
            scanner.feed(&body[from..to]);
            from = to;
        }
        let mut whole = UsageScanner::new();
        whole.feed(&body);
        prop_assert_eq!(whole.total(), Some(total), "whole body");
        prop_assert_eq!(scanner.total(), Some(total), "cut at {:?}", at);
    }
}
