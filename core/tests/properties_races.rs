//! Properties of what a bucket and the key budget admit under racing workers, checked on
//! generated schedules (proptest; the harness is `common::race`): (c) a tenant's bucket admits
//! at most `burst + workers - 1` when the creators' first requests race each other, and a burst
//! per creator under any interleaving; (e) the same bounds for the distinct keys `max_keys`
//! admits; and the two known limits of the store protocol behind the wider bounds, ignored until
//! it bounds them.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::props::config;
use common::race::{bucket_keys, governor, picks, race};
use common::T0;
use llm_governor_core::keys;
use llm_governor_core::store::MemStore;
use proptest::prelude::*;

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

/// Known limit, found by the interleavings above: with no insert-if-absent, a worker
/// descheduled between finding a new bucket missing and writing its initial (full) value
/// erases every take the other workers made meanwhile, not only the one that raced it
/// (`store::update` documents the latter). Here one worker takes the whole burst while the
/// other waits to write: 2 bursts are admitted. Ignored until the store protocol bounds it;
/// `cargo test --test properties_races -- --ignored` shows it.
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
