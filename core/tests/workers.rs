//! Several workers (Envoy's threads) over one shared store: the pace after a cooldown is the
//! (pool, account)'s, so however the held requests are spread over workers, a probe's answer
//! releases what the provider said fits, in all.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::governor;
use common::provider::{A, RL};
use common::workers::Workers;
use llm_governor_core::cooldown::CLOCK_GRAIN_MS as GRAIN;
use llm_governor_core::store::MemStore;
use llm_governor_core::worker::{Action, Stage};

const CFG: &str =
    r#"{"pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}]}"#;

/// Account A cools for 1 s: a 429 on worker 0.
fn cool(ws: &mut Workers<'_, MemStore>) {
    let (id, r) = ws.request(0, &[A]);
    assert_eq!(r.action, Action::Continue);
    ws.complete(0, id, 429, &[("retry-after", "1")], RL);
}

/// The cooldown ends: one probe leaves for all the workers, and its answer reports `left`
/// requests left. The probe (worker, stream), and what the workers let go after it.
fn probe_says(ws: &mut Workers<'_, MemStore>, left: &str) -> ((usize, u32), Vec<(usize, u32)>) {
    ws.clock.advance(1_000 + GRAIN);
    let probe = ws.tick();
    assert_eq!(probe.len(), 1, "one probe for all the workers: {probe:?}");
    let (w, id) = probe[0];
    ws.clock.advance(5);
    ws.complete(w, id, 200, &[("x-ratelimit-remaining-requests", left)], "");
    ((w, id), ws.tick_all())
}

#[test]
fn a_probes_remaining_is_shared_by_every_workers_held_requests() {
    let store = MemStore::new();
    let mut ws = Workers::new(&governor(CFG), 4, &store);
    cool(&mut ws);
    // 20 held, spread over the four workers.
    for i in 0..20 {
        let w = i % 4;
        let (id, r) = ws.request(w, &[A]);
        assert_eq!(r.action, Action::Pause);
        assert_eq!(ws.lanes[w].worker.stage(id), Stage::Held);
    }
    ws.clock.advance(1_000 + GRAIN);
    let probe = ws.tick();
    assert_eq!(probe.len(), 1, "one probe for all the workers: {probe:?}");
    let (w, id) = probe[0];
    ws.clock.advance(5);
    ws.complete(
        w,
        id,
        200,
        &[
            ("x-ratelimit-remaining-requests", "3"),
            ("x-ratelimit-reset-requests", "2s"),
        ],
        "",
    );
    let next = ws.tick_all();
    assert_eq!(next.len(), 3, "the provider said 3 fit: {next:?}");
    // Two of them answer at once, still with room (remaining counts down as they land).
    for (i, &(w, id)) in next.iter().enumerate().take(2) {
        let left = (2 - i).to_string();
        ws.complete(
            w,
            id,
            200,
            &[
                ("x-ratelimit-remaining-requests", &left),
                ("x-ratelimit-reset-requests", "2s"),
            ],
            "",
        );
    }
    let more = ws.tick_all();
    assert!(
        more.is_empty(),
        "the third is still on its way and nothing else fits: {more:?}"
    );
}

#[test]
fn answers_read_out_of_order_by_several_workers_open_no_more_than_the_newest_says() {
    let store = MemStore::new();
    let mut ws = Workers::new(&governor(CFG), 4, &store);
    cool(&mut ws);
    for i in 0..20 {
        ws.request(i % 4, &[A]);
    }
    let (_, released) = probe_says(&mut ws, "9");
    assert_eq!(released.len(), 9);
    // The provider took the first three released (9 -> 8, 7, 6 left), the other six are on
    // their way; the workers read the three answers newest first.
    for (k, left) in [(2usize, "6"), (1, "7"), (0, "8")] {
        let (w, id) = released[k];
        ws.complete(w, id, 200, &[("x-ratelimit-remaining-requests", left)], "");
    }
    let more = ws.tick_all();
    assert!(
        more.is_empty(),
        "6 left, 6 on their way: nothing fits: {more:?}"
    );
}

#[test]
fn a_burst_admitted_in_another_order_than_it_was_released_opens_nothing_more() {
    // The probe's answer leaves room for four; the four leave together. The provider takes
    // the last one released first (another worker's, overtaking on the way): its answer says
    // 3 left, but the other three took them. Counting only the releases after it, the pace
    // opened three more (three 429s in a storm with a 500 ms latency); it opens none.
    let store = MemStore::new();
    let mut ws = Workers::new(&governor(CFG), 2, &store);
    cool(&mut ws);
    for i in 0..10 {
        ws.request(i % 2, &[A]);
    }
    let (_, burst) = probe_says(&mut ws, "4");
    assert_eq!(burst.len(), 4);
    let (w, id) = burst[3];
    ws.complete(w, id, 200, &[("x-ratelimit-remaining-requests", "3")], "");
    let more = ws.tick();
    assert!(
        more.is_empty(),
        "the other three took what it saw left: {more:?}"
    );
}

#[test]
fn each_worker_holding_requests_takes_its_share_of_a_round() {
    // Worker 0 holds eight, worker 1 four. A round of six goes one release per worker and
    // tick: three each. The first worker to tick used to take the whole round.
    let store = MemStore::new();
    let mut ws = Workers::new(&governor(CFG), 2, &store);
    cool(&mut ws);
    for w in [0; 8].into_iter().chain([1; 4]) {
        ws.request(w, &[A]);
    }
    let ((w, _), round) = probe_says(&mut ws, "6");
    assert_eq!(w, 0, "the probe: worker 0's first");
    assert_eq!(round.len(), 6);
    let on_1 = round.iter().filter(|(w, _)| *w == 1).count();
    assert_eq!(on_1, 3, "worker 1's share: {round:?}");
}

#[test]
fn a_tenant_held_on_one_worker_gets_its_share_of_every_workers_releases() {
    // Batch on both workers, chat on worker 1 only. Each worker's own turns gave chat half of
    // worker 1's releases, a quarter of all; the board the workers share gives it every other
    // release of the (pool, account), whichever worker takes it.
    let cfg = r#"{"pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}}],
                  "hold": {"fair_key": "header:x-tenant-id"}}"#;
    let store = MemStore::new();
    let mut ws = Workers::new(&governor(cfg), 2, &store);
    cool(&mut ws);
    let batch = [A, ("x-tenant-id", "batch")];
    let chat = [A, ("x-tenant-id", "chat")];
    let mut tenant = std::collections::HashMap::new();
    for (w, t) in [(0, &batch); 8].into_iter().chain([
        (1, &batch),
        (1, &batch),
        (1, &chat),
        (1, &chat),
        (1, &chat),
    ]) {
        let (id, _) = ws.request(w, t);
        tenant.insert((w, id), t[1].1);
    }
    let (_, round) = probe_says(&mut ws, "6");
    let order: Vec<&str> = round.iter().map(|k| tenant[k]).collect();
    assert_eq!(order.len(), 6);
    assert_eq!(
        order.iter().filter(|t| **t == "chat").count(),
        3,
        "chat every other release: {order:?}"
    );
}
