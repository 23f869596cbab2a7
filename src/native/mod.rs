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
mod timer;

use abi::{
    Answer, Body, Callout, ConfigHandle, ConfigScheduler, MainThread, Map, Scheduler, Stream,
};
use adapters::{Discard, Io, Stats};
use llm_governor_core::effects::{Action, Direction, Effect, Lent, NoBodies, Reaction};
use llm_governor_core::fleet::grpc::{self, ServiceCall, ServiceReply};
use llm_governor_core::headers::Headers;
use llm_governor_core::keys::HashKey;
use llm_governor_core::policy::Governor;
use llm_governor_core::protocol::{self, Host};
use llm_governor_core::request::{RequestView, STEERING_HEADER};
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

/// The way to the fleet's rate-limit service.
struct Fleet {
    cluster: String,
    /// Runs `send_owed` on the main thread.
    scheduler: ConfigScheduler,
    /// The worker slot of each call the main thread sent, by callout id.
    out: Mutex<HashMap<u64, usize>>,
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
    let gov = Governor::load(json, key).and_then(|gov| {
        // Envoy refuses a callout to a cluster it lacks at once.
        protocol::check_cluster(&gov.cfg, |cluster| {
            let probe = grpc::request_headers(&grpc::health_path(), cluster);
            let call = Callout {
                cluster,
                headers: &probe,
                body: &grpc::frame(&[]),
                timeout_ms: grpc::HEALTH_CHECK_TIMEOUT_MS,
            };
            cfg.main().callout(&call) != Err(abi::CALLOUT_NO_SUCH_CLUSTER)
        })
        .map(|()| Arc::new(gov))
    });
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
    let slots = (0..workers)
        .map(|_| Slot {
            state: Mutex::new(SlotState {
                worker: Worker::new(gov.clone(), adapters::seed()),
                paused: HashMap::new(),
            }),
            next_id: AtomicU32::new(1),
        })
        .collect();
    let timer = timer::Timer::start(workers)?;
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
            target: Cell::new(s),
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

/// A stream's hooks as the core's `Host`: the worker of its slot, the current stream's handle,
/// and the paused stream a tick addresses (`target`).
struct On<'a> {
    filter: &'a Filter,
    current: Stream,
    target: Cell<Stream>,
}

impl On<'_> {
    fn handle(&self, id: u32) -> Stream {
        if id == self.filter.id {
            self.current
        } else {
            self.target.get()
        }
    }
}

impl Host for On<'_> {
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

    fn focus(&self, id: u32) -> bool {
        if id == self.filter.id {
            return true;
        }
        let state = self.filter.slot().state.lock();
        let found = state.ok().and_then(|st| st.paused.get(&id).copied());
        found.map(|t| self.target.set(t)).is_some()
    }

    fn apply(&self, id: u32, effect: Effect) -> bool {
        effect_call(self.handle(id), effect)
    }

    /// A stream's call goes out on its filter (Envoy cancels it with the stream); a call owed
    /// by no stream only from the main thread (`Main`).
    fn send(&self, stream: Option<u32>, call: &ServiceCall) -> Option<u64> {
        let t = self.handle(stream?);
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

/// The main thread as the core's `Host` of worker `slot`: it sends that worker's owed calls and
/// hears their answers. It addresses no stream.
struct Main<'a> {
    module: &'a Module,
    slot: usize,
    main: &'a MainThread,
}

impl Host for Main<'_> {
    fn with_worker<T>(
        &self,
        _: Option<u32>,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> Option<T> {
        let mut state = self.module.slots.get(self.slot)?.state.lock().ok()?;
        let mut lent = Lent {
            store: adapters::store(),
            metrics: &mut self.module.stats.on_main(self.main),
            clock: &adapters::now_ms,
            io: &mut NoBodies,
        };
        Some(f(&mut state.worker, &mut lent))
    }

    fn focus(&self, _: u32) -> bool {
        false
    }

    fn apply(&self, _: u32, _: Effect) -> bool {
        false
    }

    fn send(&self, stream: Option<u32>, call: &ServiceCall) -> Option<u64> {
        let fleet = self.module.fleet.as_ref().filter(|_| stream.is_none())?;
        let callout = fleet.send(call, |c| self.main.callout(c))?;
        if let Ok(mut out) = fleet.out.lock() {
            out.insert(callout, self.slot);
        }
        Some(callout)
    }
}

impl Fleet {
    /// `call` as gRPC in an HTTP callout made by `via` (a stream's filter, or the
    /// configuration for a call no stream owns); its callout id, or None (logged) when Envoy
    /// refuses to start it.
    fn send(
        &self,
        call: &ServiceCall,
        via: impl FnOnce(&Callout) -> Result<u64, u32>,
    ) -> Option<u64> {
        let headers = grpc::request_headers(&grpc::path(call.method), &self.cluster);
        let body = grpc::frame(&call.message);
        let sent = via(&Callout {
            cluster: &self.cluster,
            headers: &headers,
            body: &body,
            timeout_ms: call.timeout_ms,
        });
        sent.inspect_err(|why| {
            let why = abi::callout_refusal(*why);
            log::warn!(
                "llm_governor: Envoy refused a callout to {} ({why})",
                self.cluster
            );
        })
        .ok()
    }
}

impl Module {
    /// On the main thread: send every worker's owed calls.
    fn send_owed(&self, main: &MainThread) {
        for slot in 0..self.slots.len() {
            protocol::send_owed(&Main {
                module: self,
                slot,
                main,
            });
        }
    }

    /// On the main thread: an owed call came back.
    fn owed_done(&self, main: &MainThread, callout: u64, answer: &Answer) {
        let out = self.fleet.as_ref().and_then(|f| f.out.lock().ok());
        let Some(slot) = out.and_then(|mut out| out.remove(&callout)) else {
            return;
        };
        protocol::call_done(
            &Main {
                module: self,
                slot,
                main,
            },
            None,
            callout,
            reply(answer),
        );
    }
}

/// What the service's answer means to the core.
fn reply(answer: &Answer) -> ServiceReply<'_> {
    if !answer.answered {
        return ServiceReply::Failed(grpc::UNAVAILABLE); // reset or timed out
    }
    grpc::reply(
        answer.status.as_deref(),
        answer.grpc_status.as_deref(),
        &answer.body,
    )
}

/// One effect as callbacks on stream `t`; false when a callback failed.
fn effect_call(t: Stream, effect: Effect) -> bool {
    match effect {
        Effect::StripSteeringHeader => {
            let removed = t.set_header(Map::Request, STEERING_HEADER, None);
            // Envoy picked the route before the filters ran, maybe by that header: again.
            t.clear_route_cache();
            removed
        }
        Effect::Steer(pool) => {
            let set = t.set_header(Map::Request, STEERING_HEADER, Some(&pool));
            // The router picks the route again, now by the pool's header.
            t.clear_route_cache();
            set
        }
        Effect::SetResponseHeaders(hs) => hs.iter().fold(true, |ok, (n, v)| {
            t.set_header(Map::Response, n, Some(v)) & ok
        }),
        // The keys the wasm module's fields have (Envoy prefixes a wasm filter's with `wasm.`),
        // so one access-log format serves both modules.
        Effect::AccessLog(fields) => fields.iter().fold(true, |ok, (k, v)| {
            t.set_filter_state(&format!("wasm.{k}"), v) & ok
        }),
        Effect::DropRequestBody(n) => {
            // What Envoy kept so far and the chunk of this hook, if any.
            let kept = t.drain(Body::BufferedRequest, n);
            t.drain(Body::ReceivedRequest, n) | kept
        }
        Effect::SendReply(r) => {
            t.send_response(r.status, &r.headers, &r.body, r.details);
            true
        }
        Effect::ResumeRequest => {
            t.continue_decoding();
            true
        }
        Effect::ResumeResponse => {
            t.continue_encoding();
            true
        }
        Effect::CallService(_) => false, // `On::send`'s
    }
}
