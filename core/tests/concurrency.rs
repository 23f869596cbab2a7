//! Local limits under concurrency, driven the way Envoy drives them: several workers (threads),
//! each a `Worker` over one shared `Governor`, take requests against one shared store with Envoy's semantics (no
//! insert-if-absent, an unconditional set on a missing key), and each request reads a clock
//! that has moved since the previous one.
//!
//! What Envoy sees, and these tests therefore see too: every request writes the bucket it
//! looks at, refused ones included (a refusal still brings the refill timestamp up to `now`),
//! and a request refused by a later limit writes the earlier limits' buckets once more to give
//! back what it took. So a hot key is contended by refused traffic as much as by admitted
//! traffic. A write that meets a concurrent writer `MAX_CAS_ATTEMPTS` times in a row gives up
//! and admits the request (fail-open), counted as `store_contention`: each bound below allows
//! exactly one extra admission per give-up the metrics report, and nothing else.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::workers::{Lane, SharedClock, Workers};
use common::{governor as parse, T0};
use llm_governor_core::bucket::{Bucket, Shape};
use llm_governor_core::keys;
use llm_governor_core::metrics::Counter;
use llm_governor_core::policy::Governor;
use llm_governor_core::store::{self, MemStore, SharedStore, StoreError};
use llm_governor_core::worker::Action;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

/// Envoy's shared data (a `MemStore`), counting the writes and CAS conflicts each key met.
#[derive(Default)]
struct Observed {
    inner: MemStore,
    writes: AtomicUsize,
    conflicts: AtomicUsize,
}

impl SharedStore for Observed {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.inner.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let result = self.inner.set(key, value, cas);
        match result {
            Ok(()) if key.starts_with("b:") => {
                self.writes.fetch_add(1, Ordering::SeqCst);
            }
            Err(StoreError::CasMismatch) => {
                self.conflicts.fetch_add(1, Ordering::SeqCst);
            }
            _ => {}
        }
        result
    }
}

impl Observed {
    fn bucket(&self, limit: &str, key_id: u64) -> Option<Bucket> {
        let (bytes, _) = self
            .inner
            .get(&keys::bucket_key(limit, key_id))
            .ok()
            .flatten()?;
        Bucket::decode(&bytes)
    }
}

/// `n` workers over `store`, whose clock moves on after every request (a burst of requests is
/// spread over milliseconds, not all in one).
fn workers<'s>(gov: &Arc<Governor>, n: usize, store: &'s Observed) -> Workers<'s, Observed> {
    Workers::new(gov, n, store).ticking()
}

/// One request of `tenant` by `lane` at the clock's time; true when it is forwarded upstream.
fn request(lane: &mut Lane, store: &Observed, clock: &SharedClock, tenant: &str) -> bool {
    let hs = [("authorization", "Bearer sk-k"), ("x-tenant-id", tenant)];
    lane.request(store, clock.read(), &hs).1.action == Action::Continue
}

/// `request` by worker `w`, from the test's thread.
fn forwarded(ws: &mut Workers<Observed>, w: usize, tenant: &str) -> bool {
    let Workers {
        lanes,
        store,
        clock,
    } = ws;
    request(&mut lanes[w], store, clock, tenant)
}

fn governor(limits: &str) -> Arc<Governor> {
    parse(&format!(
        r#"{{"hold": {{"max_ms": 0}}, "limits": [{limits}]}}"#
    ))
}

/// What a run of workers did: requests forwarded, and fail-open give-ups counted.
struct Outcome {
    admitted: usize,
    refused: usize,
    contended: usize,
    /// Tokens the workers' leases hold or dropped unspent (taken from the bucket too).
    unspent: u64,
}

/// Every worker in a thread of its own, sending `per_worker` requests of `tenant` one after
/// the other; with `sync_first`, every worker's first request starts at the same moment and
/// completes before any worker sends its second (each worker's first request for a new
/// tenant).
fn hammer(
    ws: &mut Workers<Observed>,
    tenant: &str,
    per_worker: usize,
    sync_first: bool,
) -> Outcome {
    let barrier = Barrier::new(ws.lanes.len());
    let results = ws.in_threads(|_, lane, store, clock| {
        let contended_before = lane.metrics.count_of(0, Counter::StoreContention);
        let mut admitted = 0;
        barrier.wait();
        for i in 0..per_worker {
            admitted += usize::from(request(lane, store, clock, tenant));
            if sync_first && i == 0 {
                barrier.wait();
            }
        }
        let contended = lane.metrics.count_of(0, Counter::StoreContention) - contended_before;
        (
            admitted,
            per_worker - admitted,
            contended,
            lane.worker.leases().unspent(),
        )
    });
    Outcome {
        admitted: results.iter().map(|r| r.0).sum(),
        refused: results.iter().map(|r| r.1).sum(),
        contended: results.iter().map(|r| r.2).sum(),
        unspent: results.iter().map(|r| r.3).sum(),
    }
}

const TENANT_RPM: &str =
    r#"{"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 1, "burst": 5}"#;

#[test]
fn store_semantics_match_envoy() {
    let s = MemStore::new();
    assert_eq!(s.get("k"), Ok(None));
    // A set on a missing key succeeds whatever CAS is given.
    assert_eq!(s.set("k", b"1", Some(12345)), Ok(()));
    let (_, cas) = s.get("k").ok().flatten().unwrap_or_default();
    assert_ne!(cas, 0);
    assert_eq!(
        s.set("k", b"2", Some(cas.wrapping_add(1))),
        Err(StoreError::CasMismatch)
    );
    assert_eq!(s.set("k", b"3", Some(cas)), Ok(()));
    // Without CAS: unconditional overwrite.
    assert_eq!(s.set("k", b"4", None), Ok(()));
    assert_eq!(
        s.get("k").ok().flatten().map(|(v, _)| v),
        Some(b"4".to_vec())
    );
}

#[test]
fn a_refused_request_writes_the_bucket_when_the_clock_has_moved() {
    // The contention Envoy sees: refusals write as well, so the native hammers below contend
    // on every request, not only on the five that take a token.
    let gov = governor(TENANT_RPM);
    let store = Observed::default();
    let mut ws = workers(&gov, 1, &store);
    let admitted: Vec<bool> = (0..10).map(|_| forwarded(&mut ws, 0, "t")).collect();
    assert_eq!(admitted, [[true; 5], [false; 5]].concat());
    // The creation, five takes, and five refill timestamps.
    assert_eq!(store.writes.load(Ordering::SeqCst), 11);
    let b = store.bucket("tenant-rpm", gov.id(b"t")).unwrap();
    assert_eq!(
        b.updated_ms,
        T0 + 9,
        "the last refusal brought the bucket up to its now"
    );
}

#[test]
fn injected_conflicts_are_retried_then_given_up_and_the_request_admitted() {
    let gov = governor(TENANT_RPM);
    let store = Observed::default();
    let mut ws = workers(&gov, 1, &store);
    assert!(forwarded(&mut ws, 0, "t"));
    store.inner.inject_conflicts.store(3, Ordering::SeqCst);
    assert!(forwarded(&mut ws, 0, "t"));
    assert_eq!(ws.lanes[0].metrics.count_of(0, Counter::StoreContention), 0);
    let level = store.bucket("tenant-rpm", gov.id(b"t")).unwrap().level;
    store
        .inner
        .inject_conflicts
        .store(store::MAX_CAS_ATTEMPTS, Ordering::SeqCst);
    assert!(forwarded(&mut ws, 0, "t"), "a give-up admits");
    assert_eq!(ws.lanes[0].metrics.count_of(0, Counter::StoreContention), 1);
    // Admitted without the update: the bucket did not move.
    let after = store.bucket("tenant-rpm", gov.id(b"t")).unwrap();
    assert_eq!(after.level, level);
}

#[test]
fn many_workers_never_admit_more_than_burst_on_an_existing_bucket() {
    let gov = governor(TENANT_RPM);
    let mut worst_conflicts = 0;
    for round in 0..20 {
        let store = Observed::default();
        let mut ws = workers(&gov, 8, &store);
        let tenant = format!("t{round}");
        // The bucket exists (one earlier request took a token).
        assert!(forwarded(&mut ws, 0, &tenant));
        let run = hammer(&mut ws, &tenant, 10, false);
        assert_eq!(run.admitted + run.refused, 80);
        assert_eq!(
            1 + run.admitted,
            5 + run.contended,
            "burst 5, plus one per reported give-up"
        );
        // Refused requests wrote too (the refill timestamp), as in Envoy. One that read the
        // clock just before another worker wrote a later `now` finds nothing to change and
        // writes nothing, so this counts at most one write per refusal.
        let takes = 2 + run.admitted - run.contended;
        let refusal_writes = store.writes.load(Ordering::SeqCst) - takes;
        assert!(
            (1..=run.refused).contains(&refusal_writes),
            "{refusal_writes} writes by {} refused requests",
            run.refused
        );
        worst_conflicts = worst_conflicts.max(store.conflicts.load(Ordering::SeqCst));
    }
    eprintln!("most CAS conflicts in a round of 8 workers x 10 requests: {worst_conflicts}");
}

#[test]
fn first_write_race_admits_at_most_burst_plus_workers_minus_one() {
    // Every worker finds the key missing at once (each worker's first request for a new
    // tenant). Without insert-if-absent, a racing creator's initial write can erase takes that
    // completed between its read and its write; with one request in flight per worker, the
    // bound is burst + workers - 1.
    let racers = 4;
    let gov = governor(TENANT_RPM);
    let mut worst = 0;
    for round in 0..300 {
        let store = Observed::default();
        let run = hammer(
            &mut workers(&gov, racers, &store),
            &format!("t{round}"),
            11,
            true,
        );
        assert!(
            (5..=5 + racers - 1 + run.contended).contains(&run.admitted),
            "admitted {} ({} give-ups)",
            run.admitted,
            run.contended
        );
        worst = worst.max(run.admitted - run.contended);
    }
    eprintln!("worst admitted with {racers} racing creators: {worst} (burst 5)");
}

#[test]
fn a_request_refused_by_a_later_limit_gives_its_tokens_back_under_contention() {
    // A wide per-pool bucket, then a narrow per-tenant one: every request refused by the
    // narrow one writes the wide one twice (take, give back).
    let gov = governor(&format!(
        r#"{{"name": "pool-rpm", "key": "pool", "requests_per_minute": 1, "burst": 100}}, {TENANT_RPM}"#
    ));
    let pool_id = gov.id(b"default");
    for round in 0..20 {
        let store = Observed::default();
        let mut ws = workers(&gov, 8, &store);
        let tenant = format!("t{round}");
        // Both buckets exist (one earlier request took from each): no first-write race.
        assert!(forwarded(&mut ws, 0, &tenant));
        let run = hammer(&mut ws, &tenant, 10, false);
        assert_eq!(1 + run.admitted, 5 + run.contended);
        // The pool bucket lost exactly one token per admitted request: each request the
        // tenant bucket refused gave its token back. A give-up can move it by one either way
        // (a take or a give-back that did not happen), and the metrics report each one.
        let wide = store.bucket("pool-rpm", pool_id).unwrap();
        let tokens = wide.tokens();
        let expected = 100 - 1 - run.admitted as i64;
        assert!(
            (tokens - expected).unsigned_abs() as usize <= run.contended,
            "pool bucket holds {tokens} tokens after {} admitted ({} give-ups)",
            1 + run.admitted,
            run.contended
        );
    }
}

#[test]
fn a_token_that_was_never_taken_is_not_given_back() {
    let gov = governor(&format!(
        r#"{{"name": "pool-rpm", "key": "pool", "requests_per_minute": 1, "burst": 100}}, {TENANT_RPM}"#
    ));
    let store = Observed::default();
    let mut ws = workers(&gov, 1, &store);
    for _ in 0..5 {
        assert!(forwarded(&mut ws, 0, "t"));
    }
    let pool_id = gov.id(b"default");
    let before = store.bucket("pool-rpm", pool_id).unwrap();
    // The pool bucket's take meets a concurrent writer every time and gives up (the request
    // goes on, fail-open); the tenant bucket then refuses it.
    store
        .inner
        .inject_conflicts
        .store(store::MAX_CAS_ATTEMPTS, Ordering::SeqCst);
    assert!(!forwarded(&mut ws, 0, "t"));
    assert_eq!(ws.lanes[0].metrics.count_of(0, Counter::StoreContention), 1);
    let after = store.bucket("pool-rpm", pool_id).unwrap();
    // Nothing was taken from the pool bucket, so nothing may be given back (refill over the
    // 6 ms this test's clock moved is far below a token).
    let shape = Shape::from(&gov.cfg.limits[0]);
    let one_token_more = before.give(shape, before.updated_ms, 1);
    assert!(
        after.level < one_token_more.level,
        "the pool bucket gained a token it never lost: {before:?} -> {after:?}"
    );
}

#[test]
fn contention_on_a_hot_key_loses_no_update() {
    // Four workers, 2000 requests each, on one pool-keyed bucket that never runs dry.
    let gov = governor(
        r#"{"name": "pool-rpm", "key": "pool", "requests_per_minute": 1, "burst": 1000000}"#,
    );
    let store = Observed::default();
    let mut ws = workers(&gov, 4, &store);
    // The bucket exists before the workers start: no first-write race.
    assert!(forwarded(&mut ws, 0, "t"));
    let run = hammer(&mut ws, "t", 2_000, false);
    assert_eq!(run.admitted, 8_000);
    let b = store.bucket("pool-rpm", gov.id(b"default")).unwrap();
    // What the workers' leases (lease.rs) hold or dropped unspent was taken from the bucket
    // too.
    let stock = run.unspent;
    let taken = (1 + 8_000 - run.contended) as u64 + stock;
    // Every completed take is reflected exactly once (no lost update under CAS), and the
    // refill is exact however often it ran: the bucket holds what one that lost all those
    // tokens at its creation (the first request, at T0) holds at its latest write.
    let shape = Shape::from(&gov.cfg.limits[0]);
    let sequential = Bucket::full(shape, T0)
        .charge(shape, T0, taken)
        .refill(shape, b.updated_ms);
    assert_eq!(b, sequential);
    eprintln!(
        "8000 requests from 4 workers: {} CAS conflicts, {} given up",
        store.conflicts.load(Ordering::SeqCst),
        run.contended
    );
}

#[test]
fn leases_admit_exactly_the_bucket_across_workers_and_spare_shared_data() {
    // Four workers (four lease maps) on one bucket of 2,000 that does not refill during the test: leases are taken while it is far from empty, one CAS a request
    // near the end. Every worker sends until refused: the bucket admits exactly 2,000.
    let limit = r#"{"name": "pool-rpm", "key": "pool", "requests_per_minute": 1, "burst": 2000}"#;
    let gov = governor(limit);
    let store = Observed::default();
    let mut ws = workers(&gov, 4, &store);
    assert!(forwarded(&mut ws, 0, "t"));
    let admitted: Vec<usize> = ws.in_threads(|_, lane, store, clock| {
        let mut n = 0;
        while request(lane, store, clock, "t") {
            n += 1;
        }
        n
    });
    // The test clock moves 1 ms a request: some leases expire with tokens left, which were
    // taken from the bucket and are never spent (fewer admitted, never more).
    let unspent: u64 = ws.lanes.iter().map(|l| l.worker.leases().unspent()).sum();
    assert_eq!(
        1 + admitted.iter().sum::<usize>() as u64 + unspent,
        2000,
        "{admitted:?}"
    );
    assert!(
        unspent <= 4 * 4 * (llm_governor_core::lease::LEASE - 1),
        "{unspent}"
    );
    // Far fewer writes than requests: most requests spent a lease.
    let writes = store.writes.load(Ordering::SeqCst);
    assert!(writes < 2000 / 2, "{writes} writes for 2000 requests");
}

#[test]
fn near_empty_every_request_is_one_compare_and_swap() {
    // A bucket below the lease floor never lends: the e2e budget tests' burst 5 stays exact.
    let gov =
        governor(r#"{"name": "pool-rpm", "key": "pool", "requests_per_minute": 1, "burst": 500}"#);
    let store = Observed::default();
    let mut ws = workers(&gov, 1, &store);
    for _ in 0..20 {
        assert!(forwarded(&mut ws, 0, "t"));
    }
    let key = (0, gov.id(b"default"));
    assert_eq!(ws.lanes[0].worker.leases().left(key, ws.clock.now()), 0);
    let b = store.bucket("pool-rpm", gov.id(b"default")).unwrap();
    assert_eq!(b.tokens(), 480);
}

#[test]
fn what_an_expired_lease_left_goes_back_with_the_next_take() {
    // A tenant sending less than a lease a second: each lease expires with tokens left, and
    // the next request's compare-and-swap gives them back, so the bucket only loses what was
    // used.
    let gov =
        governor(r#"{"name": "pool-rpm", "key": "pool", "requests_per_minute": 1, "burst": 2000}"#);
    let store = Observed::default();
    let mut ws = workers(&gov, 1, &store);
    for _ in 0..10 {
        assert!(forwarded(&mut ws, 0, "t"));
        ws.clock.advance(llm_governor_core::lease::LEASE_MS); // a second passes
    }
    let b = store.bucket("pool-rpm", gov.id(b"default")).unwrap();
    let held = ws.lanes[0].worker.leases().unspent();
    assert_eq!(
        held,
        llm_governor_core::lease::LEASE - 1,
        "the last lease, still held"
    );
    // 10 used, 7 held by the last lease; the refill over the test's ~10 s is < 1 token.
    assert_eq!(b.tokens(), 2000 - 10 - 7);
}
