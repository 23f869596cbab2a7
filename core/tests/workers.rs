//! Several workers (Envoy's threads) over one shared store: the pace after a cooldown is the
//! (pool, account)'s, so however the held requests are spread over workers, a probe's answer
//! releases what the provider said fits, in all.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{test_key, view, FakeIo, FixedRng, T0};
use llm_governor_core::config;
use llm_governor_core::cooldown::CLOCK_GRAIN_MS as GRAIN;
use llm_governor_core::headers::{owned, Headers};
use llm_governor_core::metrics::Recorded;
use llm_governor_core::policy::Governor;
use llm_governor_core::store::MemStore;
use llm_governor_core::worker::{Action, Effect, Lent, Reaction, Stage, Worker};
use std::sync::Arc;

const PATH: &str = "/v1/chat/completions";
const A: (&str, &str) = ("authorization", "Bearer sk-a");
const RL: &str = r#"{"error":{"type":"requests","code":"rate_limit_exceeded","message":"x"}}"#;

struct Fleet {
    workers: Vec<Worker>,
    store: MemStore,
    metrics: Recorded,
    io: FakeIo,
    now: u64,
}

impl Fleet {
    fn new(n: usize) -> Fleet {
        let cfg = config::parse(br#"{"pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}]}"#).unwrap();
        let gov = Arc::new(Governor::new(cfg, test_key()));
        let workers = (0..n)
            .map(|_| Worker::with_random(Arc::clone(&gov), Box::new(FixedRng::new(0.0))))
            .collect();
        Fleet {
            workers,
            store: MemStore::new(),
            metrics: Recorded::default(),
            io: FakeIo::default(),
            now: T0,
        }
    }

    fn call<T>(&mut self, w: usize, f: impl FnOnce(&mut Worker, &mut Lent) -> T) -> T {
        let now = self.now;
        let clock = move || now;
        let mut lent = Lent {
            store: &self.store,
            metrics: &mut self.metrics,
            clock: &clock,
            io: &mut self.io,
        };
        f(&mut self.workers[w], &mut lent)
    }

    fn request(&mut self, w: usize, id: u32) -> Reaction {
        let hs = owned(&[A]);
        let v = view(PATH, &hs);
        self.call(w, |wk, lent| wk.on_request_headers(id, &v, true, lent))
    }

    fn respond(&mut self, w: usize, id: u32, status: &str, hs: &[(&str, &str)], body: &str) {
        let mut all = vec![(":status", status)];
        all.extend_from_slice(hs);
        let hs = owned(&all);
        self.io.response_bodies.insert(id, body.as_bytes().to_vec());
        let eos = body.is_empty();
        let r = self.call(w, |wk, lent| {
            wk.on_response_headers(id, &Headers::new(&hs), eos, lent)
        });
        if r.action == Action::Pause {
            let n = body.len();
            self.call(w, |wk, lent| wk.on_response_body(id, n, true, lent));
        }
        self.call(w, |wk, lent| wk.on_end(id, lent));
    }

    /// Every worker's tick: the streams each let go upstream.
    fn tick(&mut self) -> Vec<(usize, u32)> {
        let mut out = Vec::new();
        for w in 0..self.workers.len() {
            for (id, r) in self.call(w, |wk, lent| wk.tick(lent)) {
                if r.effects.contains(&Effect::ResumeRequest) {
                    out.push((w, id));
                }
            }
        }
        out
    }
}

#[test]
fn a_probes_remaining_is_shared_by_every_workers_held_requests() {
    let mut fleet = Fleet::new(4);
    assert_eq!(fleet.request(0, 1).action, Action::Continue);
    fleet.respond(0, 1, "429", &[("retry-after", "1")], RL);
    // 20 held, spread over the four workers.
    for id in 10..30u32 {
        let w = (id % 4) as usize;
        assert_eq!(fleet.request(w, id).action, Action::Pause);
        assert_eq!(fleet.workers[w].stage(id), Stage::Held);
    }
    fleet.now += 1_000 + GRAIN;
    let probe = fleet.tick();
    assert_eq!(probe.len(), 1, "one probe for the whole fleet: {probe:?}");
    let (w, id) = probe[0];
    fleet.now += 5;
    fleet.respond(
        w,
        id,
        "200",
        &[
            ("x-ratelimit-remaining-requests", "3"),
            ("x-ratelimit-reset-requests", "2s"),
        ],
        "",
    );
    let next = fleet.tick();
    assert_eq!(next.len(), 3, "the provider said 3 fit: {next:?}");
    // Two of them answer at once, still with room (remaining counts down as they land).
    for (i, &(w, id)) in next.iter().enumerate().take(2) {
        let left = (2 - i).to_string();
        fleet.respond(
            w,
            id,
            "200",
            &[
                ("x-ratelimit-remaining-requests", &left),
                ("x-ratelimit-reset-requests", "2s"),
            ],
            "",
        );
    }
    let more = fleet.tick();
    assert!(
        more.is_empty(),
        "the third is still on its way and nothing else fits: {more:?}"
    );
}

#[test]
fn answers_read_out_of_order_by_several_workers_open_no_more_than_the_newest_says() {
    let mut fleet = Fleet::new(4);
    fleet.request(0, 1);
    fleet.respond(0, 1, "429", &[("retry-after", "1")], RL);
    for id in 10..30u32 {
        fleet.request((id % 4) as usize, id);
    }
    fleet.now += 1_000 + GRAIN;
    let probe = fleet.tick();
    let (w, id) = probe[0];
    fleet.now += 5;
    fleet.respond(w, id, "200", &[("x-ratelimit-remaining-requests", "9")], "");
    let released = fleet.tick();
    assert_eq!(released.len(), 9);
    // The provider took the first three released (9 -> 8, 7, 6 left), the other six are on
    // their way; the workers read the three answers newest first.
    for (k, left) in [(2usize, "6"), (1, "7"), (0, "8")] {
        let (w, id) = released[k];
        fleet.respond(
            w,
            id,
            "200",
            &[("x-ratelimit-remaining-requests", left)],
            "",
        );
    }
    let more = fleet.tick();
    assert!(
        more.is_empty(),
        "6 left, 6 on their way: nothing fits: {more:?}"
    );
}
