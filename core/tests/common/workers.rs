//! Several workers (Envoy's worker threads, one VM each) over one shared store and one clock:
//! each worker has its own streams, leases, randomness, stats and buffers, as in Envoy. Driven
//! in turn from the test's thread (`request`, `complete`, `tick`), or each worker from a thread
//! of its own (`in_threads`).

use super::{arrive_headers, deliver_response, FakeIo, FixedRng, PATH, T0};
use llm_governor_core::headers::owned;
use llm_governor_core::metrics::Recorded;
use llm_governor_core::policy::Governor;
use llm_governor_core::store::SharedStore;
use llm_governor_core::worker::{Effect, Lent, Reaction, Worker};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Envoy's clock as every worker reads it: the test moves it (`advance`), and a ticking clock
/// moves on 1 ms after each request reads it (a burst is spread over milliseconds, not all in
/// one).
pub struct SharedClock {
    now: AtomicU64,
    step: u64,
}

impl SharedClock {
    /// The time a request reads (the next one reads it later, when the clock ticks).
    pub fn read(&self) -> u64 {
        self.now.fetch_add(self.step, Ordering::SeqCst)
    }

    /// The time, without reading it as a request does.
    pub fn now(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }

    pub fn advance(&self, ms: u64) {
        self.now.fetch_add(ms, Ordering::SeqCst);
    }
}

/// One worker and what it does not share: its randomness, stats, buffers and stream ids.
pub struct Lane {
    pub worker: Worker,
    pub rng: FixedRng,
    pub metrics: Recorded,
    pub io: FakeIo,
    next_id: u32,
}

impl Lane {
    /// Call the worker with `store` (the shared one, or a wrapper of it), at `now`.
    pub fn call<T>(
        &mut self,
        store: &dyn SharedStore,
        now: u64,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> T {
        let clock = move || now;
        let mut lent = Lent {
            store,
            metrics: &mut self.metrics,
            clock: &clock,
            io: &mut self.io,
        };
        f(&mut self.worker, &mut lent)
    }

    /// Request headers (no body) of this worker's next stream at `PATH`, at `now`: its id and
    /// the reaction.
    pub fn request(
        &mut self,
        store: &dyn SharedStore,
        now: u64,
        headers: &[(&str, &str)],
    ) -> (u32, Reaction) {
        self.next_id += 1;
        let id = self.next_id;
        let hs = owned(headers);
        let r = self.call(store, now, |w, lent| {
            arrive_headers(w, lent, id, PATH, &hs, true)
        });
        (id, r)
    }
}

/// Several workers over one shared store (`S`: Envoy's shared data, or a wrapper that
/// observes it) and one clock.
pub struct Workers<'s, S> {
    pub lanes: Vec<Lane>,
    pub store: &'s S,
    pub clock: SharedClock,
}

impl<'s, S: SharedStore + Sync> Workers<'s, S> {
    /// `n` workers of `gov` over `store`, drawing 0, the clock frozen at `T0`.
    pub fn new(gov: &Arc<Governor>, n: usize, store: &'s S) -> Workers<'s, S> {
        let lanes = (0..n)
            .map(|_| {
                let rng = FixedRng::new(0.0);
                Lane {
                    worker: Worker::with_random(Arc::clone(gov), Box::new(rng.clone())),
                    rng,
                    metrics: Recorded::default(),
                    io: FakeIo::default(),
                    next_id: 0,
                }
            })
            .collect();
        Workers {
            lanes,
            store,
            clock: SharedClock {
                now: AtomicU64::new(T0),
                step: 0,
            },
        }
    }

    /// The clock moves on 1 ms after each request reads it.
    pub fn ticking(mut self) -> Self {
        self.clock.step = 1;
        self
    }

    /// Every worker draws `u`.
    pub fn drawing(self, u: f64) -> Self {
        for lane in &self.lanes {
            lane.rng.set(u);
        }
        self
    }

    /// Call worker `w` at the clock's time.
    pub fn call<T>(&mut self, w: usize, f: impl FnOnce(&mut Worker, &mut Lent) -> T) -> T {
        let now = self.clock.read();
        self.lanes[w].call(self.store, now, f)
    }

    /// Request headers (no body) of worker `w`'s next stream: its id and the reaction.
    pub fn request(&mut self, w: usize, headers: &[(&str, &str)]) -> (u32, Reaction) {
        let now = self.clock.read();
        self.lanes[w].request(self.store, now, headers)
    }

    /// The whole response to worker `w`'s stream `id` (headers, then the body if any), then
    /// the stream's end.
    pub fn complete(
        &mut self,
        w: usize,
        id: u32,
        status: u16,
        headers: &[(&str, &str)],
        body: &str,
    ) {
        let hs = owned(headers);
        let lane = &mut self.lanes[w];
        lane.io.response_bodies.insert(id, body.as_bytes().to_vec());
        self.call(w, |wk, lent| {
            deliver_response(wk, lent, id, status, &hs, body.len());
            wk.on_end(id, lent);
        });
    }

    /// Every worker's tick: the streams each let go upstream, as (worker, stream).
    pub fn tick(&mut self) -> Vec<(usize, u32)> {
        let mut out = Vec::new();
        for w in 0..self.lanes.len() {
            for (id, r) in self.call(w, |wk, lent| wk.tick(lent)) {
                if r.effects.contains(&Effect::ResumeRequest) {
                    out.push((w, id));
                }
            }
        }
        out
    }

    /// Tick every worker now, then every `TICK_MS`, until two rounds of ticks in a row let
    /// nothing go (each worker lets one release of the pace go per (pool, account) and tick,
    /// and may leave one to another worker's next tick).
    pub fn tick_all(&mut self) -> Vec<(usize, u32)> {
        let mut all = self.tick();
        let mut quiet = 0;
        while quiet < 2 {
            self.clock.advance(llm_governor_core::effects::TICK_MS);
            let out = self.tick();
            quiet = if out.is_empty() { quiet + 1 } else { 0 };
            all.extend(out);
        }
        all
    }

    /// `f` for every worker, each in a thread of its own, all at once, over the shared store
    /// and clock: what it returned, in the workers' order.
    pub fn in_threads<T: Send>(
        &mut self,
        f: impl Fn(usize, &mut Lane, &S, &SharedClock) -> T + Sync,
    ) -> Vec<T> {
        let (store, clock, f) = (self.store, &self.clock, &f);
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .lanes
                .iter_mut()
                .enumerate()
                .map(|(i, lane)| s.spawn(move || f(i, lane, store, clock)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        })
    }
}
