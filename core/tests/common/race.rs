//! Racing workers over one shared store, for the properties of what a bucket and the key
//! budget admit. The workers are real threads, but only one of them touches the store at a
//! time, in an order the test generates (`Interleaving`), so a failing schedule shrinks and
//! replays like any other input.

use super::workers::Workers;
use llm_governor_core::config;
use llm_governor_core::keys;
use llm_governor_core::metrics::Counter;
use llm_governor_core::policy::Governor;
use llm_governor_core::store::{MemStore, SharedStore, StoreError};
use llm_governor_core::worker::Action;
use proptest::prelude::*;
use std::sync::Arc;
use std::sync::{Condvar, Mutex};

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
pub struct Outcome {
    pub forwarded: usize,
    pub contended: usize,
    blind_writes: Vec<String>,
}

impl Outcome {
    /// How many workers wrote a key starting with `prefix` as its creator.
    pub fn creators(&self, prefix: &str) -> u64 {
        self.blind_writes
            .iter()
            .filter(|k| k.starts_with(prefix))
            .count() as u64
    }
}

/// Worker `w` sends `requests[w]` (tenant id, time) one after another through its `Worker`,
/// all workers at once, store operations in the order `picks` says; worker 0 is descheduled
/// before its first write of a key starting with `starve`.
pub fn race(
    governor: &Arc<Governor>,
    store: &MemStore,
    requests: &[Vec<(String, u64)>],
    picks: Vec<u8>,
    starve: Option<&str>,
) -> Outcome {
    let order = Interleaving::new(requests.len(), picks);
    let blind_writes = Mutex::new(Vec::new());
    let mut workers = Workers::new(governor, requests.len(), store).drawing(0.5);
    let outcomes: Vec<Outcome> = workers.in_threads(|me, lane, store, _| {
        let store = WorkerStore {
            store,
            order: &order,
            me,
            starve_before_blind_write: starve.filter(|_| me == 0),
            blind_writes: &blind_writes,
        };
        let mut forwarded = 0;
        for (tenant, now_ms) in &requests[me] {
            let (_, r) = lane.request(&store, *now_ms, &[("x-tenant-id", tenant)]);
            if r.action == Action::Continue {
                forwarded += 1;
            }
        }
        order.done(me);
        Outcome {
            forwarded,
            contended: lane.metrics.count_of(0, Counter::StoreContention),
            blind_writes: Vec::new(),
        }
    });
    Outcome {
        forwarded: outcomes.iter().map(|o| o.forwarded).sum(),
        contended: outcomes.iter().map(|o| o.contended).sum(),
        blind_writes: blind_writes.into_inner().unwrap(),
    }
}

pub fn governor(json: &str) -> Arc<Governor> {
    Arc::new(Governor::new(
        config::parse(json.as_bytes()).unwrap(),
        keys::HashKey::from_words(1, 2),
    ))
}

/// Store operations in any order: mostly random, sometimes one worker starved for long runs.
pub fn picks() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        3 => prop::collection::vec(any::<u8>(), 1..64),
        1 => prop::collection::vec(prop_oneof![5 => Just(1u8), 1 => Just(0u8)], 1..64),
    ]
}

/// Distinct per-tenant bucket keys in the store (the shared overflow key aside).
pub fn bucket_keys(store: &MemStore) -> u64 {
    store
        .dump()
        .into_iter()
        .filter(|(k, _)| k.starts_with("b:") && !k.ends_with(":~"))
        .count() as u64
}
