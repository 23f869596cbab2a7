//! The dynamic-module host (Envoy ≥ 1.40): the only code that names the dynamic-module ABI, in
//! the shape of the proxy-wasm host (`../host/`). Each hook becomes a call of the core's
//! `protocol` over `Host`: a worker's core `Worker` and the ABI's callbacks. Nothing here
//! decides.
//!
//! What differs from proxy-wasm is only the mechanism:
//! - one configuration object (`Module`) for every worker thread; each Envoy worker has its own
//!   core `Worker` behind an (uncontended) mutex, as proxy-wasm has one per VM;
//! - state shared by the workers is process memory (`store`), with shared data's semantics;
//! - no tick: a worker that waits for time arms the module's timer thread (`timer`), which
//!   commits to the scheduler of one of the worker's paused streams at the deadline; that
//!   stream's `scheduled` hook runs the worker's tick on the worker's own thread;
//! - stats are families with real labels (`llm_pool`, `class`, `reason`, `dimension`, `outcome`);
//! - the fleet's service is called with HTTP callouts carrying gRPC (`fleet::grpc`): a stream's
//!   own calls on its filter, the calls owed by no stream (commits after a stream's end) on the
//!   configuration, from the main thread, through the config's scheduler.

mod abi;
mod adapters;
mod fleet;
mod timer;

use abi::{Answer, Body, Callout, ConfigHandle, ConfigScheduler, Map, Scheduler, Stream};
use adapters::{Discard, Io, Stats};
use fleet::{reply, Fleet};
use llm_governor_core::effects::{Action, Direction, Lent, NoBodies, Reaction};
use llm_governor_core::fleet::grpc::{self, ServiceCall};
use llm_governor_core::headers::Headers;
use llm_governor_core::keys::HashKey;
use llm_governor_core::protocol::{self, Host};
use llm_governor_core::request::RequestView;
use llm_governor_core::worker::Worker;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// The program's first hook: route the `log` crate to Envoy's log.
fn init() {
    adapters::install_logger();
}

/// One configuration of the filter, shared by every worker thread.
pub struct Module {
    stats: Stats,
    slots: Vec<Slot>,
    timer: Arc<timer::Timer>,
    fleet: Option<Fleet>,
}

/// One Envoy worker's core `Worker` and the streams it may address from a tick.
struct Slot {
    state: Mutex<SlotState>,
    next_id: AtomicU32,
}

struct SlotState {
    worker: Worker,
    /// Streams that paused (the only ones a tick addresses), until their destroy hook.
    paused: HashMap<u32, Stream>,
}

fn config_new(cfg: &ConfigHandle, _name: &[u8], json: &[u8]) -> Option<Arc<Module>> {
    let key = HashKey::for_host(adapters::store(), adapters::seed);
    let exists = |cluster: &str| {
        let probe = grpc::request_headers(&grpc::health_path(), cluster);
        let body = grpc::frame(&[]);
        let timeout_ms = grpc::HEALTH_CHECK_TIMEOUT_MS;
        let call = Callout {
            cluster,
            headers: &probe,
            body: &body,
            timeout_ms,
        };
        cfg.main().callout(&call) != Err(abi::CALLOUT_NO_SUCH_CLUSTER)
    };
    let gov = protocol::load(json, key, exists).map(Arc::new);
    let gov = gov.inspect_err(|e| log::error!("llm_governor: {e}")).ok()?;
    let fleet = match &gov.cfg.fleet {
        None => None,
        Some(f) => {
            let Some(scheduler) = ConfigScheduler::new(cfg) else {
                log::error!("llm_governor: fleet: Envoy gave no scheduler for the fleet's calls");
                return None;
            };
            let cluster = f.cluster.clone();
            let out = Mutex::new(HashMap::new());
            Some(Fleet {
                cluster,
                scheduler,
                out,
            })
        }
    };
    let stats = Stats::define(cfg, &gov.cfg);
    let workers = abi::concurrency().max(1) as usize;
    let slots: Vec<Slot> = (0..workers)
        .map(|_| Slot {
            state: Mutex::new(SlotState {
                worker: Worker::new(gov.clone(), adapters::seed()),
                paused: HashMap::new(),
            }),
            next_id: AtomicU32::new(1),
        })
        .collect();
    let idle = fleet.as_ref().and_then(|_| ConfigScheduler::new(cfg));
    let timer = timer::Timer::start(workers, idle)?;
    // A worker that watches the fleet's cooldowns ticks from now on (`fleet::watch`).
    for (w, slot) in slots.iter().enumerate() {
        let next = slot
            .state
            .lock()
            .ok()
            .and_then(|st| st.worker.next_due_ms());
        timer.arm(w, next);
    }
    Some(Arc::new(Module {
        stats,
        slots,
        timer,
        fleet,
    }))
}

fn config_destroy(module: Arc<Module>) {
    module.timer.stop();
}

fn filter_new(module: Arc<Module>, stream: Stream) -> Filter {
    module.stats.exist(stream);
    let slot = stream.worker_index() as usize % module.slots.len();
    let id = module.slots[slot].next_id.fetch_add(1, Ordering::Relaxed);
    Filter {
        module,
        slot,
        id,
        paused: Cell::new(false),
        ended: false,
    }
}

/// Our filter of one stream.
pub struct Filter {
    module: Arc<Module>,
    slot: usize,
    id: u32,
    /// It paused at least once: it is in the slot's `paused` map and has a scheduler.
    paused: Cell<bool>,
    /// Its end was handled (`complete`): the destroy hook has only its registrations to drop.
    ended: bool,
}

impl Filter {
    fn request_headers(&mut self, s: Stream, end_of_stream: bool) -> bool {
        s.with_headers(Map::Request, |pairs| {
            let view = RequestView::of(Headers::borrowed(pairs));
            self.react(s, |w, id, lent| {
                w.on_request_headers(id, &view, end_of_stream, lent)
            })
        })
    }

    fn request_body(&mut self, s: Stream, end_of_stream: bool) -> bool {
        if !self.reads_body(Direction::Request) {
            return false; // most chunks: nothing to read, nothing to wait for
        }
        // What Envoy buffers for the filter: what it kept so far and this chunk.
        let size = s.body_size(Body::BufferedRequest) + s.body_size(Body::ReceivedRequest);
        self.react(s, |w, id, lent| {
            w.on_request_body(id, size, end_of_stream, lent)
        })
    }

    fn request_trailers(&mut self, s: Stream) -> bool {
        self.react(s, |w, id, lent| w.on_request_trailers(id, lent))
    }

    fn response_headers(&mut self, s: Stream, end_of_stream: bool) -> bool {
        let state = self.slot().state.lock();
        if !state.is_ok_and(|st| st.worker.reads_response_headers(self.id)) {
            return false; // no read of the map for a stream nothing governs
        }
        s.with_headers(Map::Response, |pairs| {
            let headers = Headers::borrowed(pairs);
            self.react(s, |w, id, lent| {
                w.on_response_headers(id, &headers, end_of_stream, lent)
            })
        })
    }

    fn response_body(&mut self, s: Stream, end_of_stream: bool) -> bool {
        if !self.reads_body(Direction::Response) {
            return false;
        }
        let size = s.body_size(Body::BufferedResponse) + s.body_size(Body::ReceivedResponse);
        self.react(s, |w, id, lent| {
            w.on_response_body(id, size, end_of_stream, lent)
        })
    }

    fn response_trailers(&mut self, s: Stream) -> bool {
        self.react(s, |w, id, lent| w.on_response_trailers(id, lent))
    }

    /// The stream is over (complete, reset or cancelled), before the access log is written.
    fn complete(&mut self, s: Stream) {
        protocol::end(&self.on(s), self.id);
        self.after();
        self.ended = true;
    }

    /// The timer thread's event: the worker's tick, each due stream's reaction applied to it.
    fn scheduled(&mut self, s: Stream) {
        protocol::tick(&self.on(s));
        self.after();
    }

    /// This stream's call to the fleet's service came back.
    fn callout_done(&self, s: Stream, callout: u64, answer: &Answer) {
        protocol::call_done(&self.on(s), Some(self.id), callout, reply(answer));
        self.after();
    }

    /// A hook of this stream through the core's protocol; whether the stream pauses.
    fn react(
        &mut self,
        s: Stream,
        f: impl FnOnce(&mut Worker, u32, &mut Lent) -> Reaction,
    ) -> bool {
        let action = protocol::callback(&self.on(s), self.id, f);
        self.after();
        action == Action::Pause
    }

    /// This stream's hooks as the core's `Host`, the current stream being `s`.
    fn on(&self, s: Stream) -> On<'_> {
        On {
            filter: self,
            current: s,
        }
    }

    /// Whether the worker has a use for this chunk of the request's (or response's) body.
    fn reads_body(&self, direction: Direction) -> bool {
        let state = self.slot().state.lock();
        state.is_ok_and(|st| st.worker.reads_body(self.id, direction))
    }

    fn slot(&self) -> &Slot {
        &self.module.slots[self.slot]
    }

    /// After a hook: tell the timer when this worker next has something to do, and the main
    /// thread when it owes the service calls that belong to no stream.
    fn after(&self) {
        let (next, owes) = match self.slot().state.lock() {
            Ok(mut st) => (st.worker.next_due_ms(), st.worker.calls().owes()),
            Err(_) => (None, false),
        };
        self.module.timer.arm(self.slot, next);
        if let (true, Some(fleet)) = (owes, &self.module.fleet) {
            fleet.scheduler.commit(0);
        }
    }
}

impl Drop for Filter {
    /// The stream's destroy hook: forget it everywhere (its end was normally handled by
    /// `complete`; Envoy's filter object is no longer ours to call, so stats are dropped).
    fn drop(&mut self) {
        if self.ended && !self.paused.get() {
            return; // the usual stream: nothing of it is left anywhere
        }
        let id = self.id;
        if let Ok(mut st) = self.slot().state.lock() {
            st.paused.remove(&id);
            let mut lent = Lent {
                store: adapters::store(),
                metrics: &mut Discard,
                clock: &adapters::now_ms,
                // No stream to read from (its filter object is gone): the core's empty buffers.
                io: &mut NoBodies,
            };
            st.worker.on_end(id, &mut lent);
        }
        if self.paused.get() {
            self.module.timer.remove_waker(self.slot, id);
        }
        self.after();
    }
}

/// A stream's hooks as the core's `Host`: the worker of its slot and the current stream.
struct On<'a> {
    filter: &'a Filter,
    current: Stream,
}

impl Host for On<'_> {
    type Stream = Stream;

    fn with_worker<T>(
        &self,
        _: Option<u32>,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> Option<T> {
        let mut state = self.filter.slot().state.lock().ok()?;
        let SlotState { worker, paused } = &mut *state;
        let mut stats = self.filter.module.stats.on(self.current);
        let mut io = Io {
            current: (self.filter.id, self.current),
            paused,
        };
        let mut lent = Lent {
            store: adapters::store(),
            metrics: &mut stats,
            clock: &adapters::now_ms,
            io: &mut io,
        };
        Some(f(worker, &mut lent))
    }

    fn current(&self, _: u32) -> Stream {
        self.current
    }

    /// The current stream, or a paused one (the only ones a tick addresses).
    fn stream(&self, id: u32) -> Option<Stream> {
        if id == self.filter.id {
            return Some(self.current);
        }
        let state = self.filter.slot().state.lock();
        state.ok().and_then(|st| st.paused.get(&id).copied())
    }

    /// A stream's call goes out on its filter (Envoy cancels it with the stream); a call owed
    /// by no stream only from the main thread (`Main`).
    fn send(&self, stream: Option<&Stream>, call: &ServiceCall) -> Option<u64> {
        let t = *stream?;
        self.filter
            .module
            .fleet
            .as_ref()?
            .send(call, |c| t.callout(c))
    }

    /// Its scheduler can wake the worker while it waits.
    fn paused(&self, id: u32) {
        let f = self.filter;
        if id != f.id || f.paused.replace(true) {
            return;
        }
        if let Ok(mut st) = f.slot().state.lock() {
            st.paused.insert(id, self.current);
        }
        if let Some(scheduler) = Scheduler::new(self.current) {
            f.module.timer.add_waker(f.slot, id, scheduler);
        }
    }
}
