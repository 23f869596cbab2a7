//! The dynamic-module host (Envoy ≥ 1.40): the only code that names the dynamic-module ABI, in
//! the shape of the proxy-wasm host (`../host/`). Each hook becomes a call into the core's
//! `Worker`, and the `Reaction` it returns becomes callbacks. Nothing here decides.
//!
//! What differs from proxy-wasm is only the mechanism:
//! - one configuration object (`Module`) for every worker thread; each Envoy worker has its own
//!   core `Worker` behind an (uncontended) mutex, as proxy-wasm has one per VM;
//! - state shared by the workers is process memory (`store`), with shared data's semantics;
//! - no tick: a worker that waits for time arms the module's timer thread (`timer`), which
//!   commits to the scheduler of one of the worker's paused streams at the deadline; that
//!   stream's `scheduled` hook runs the worker's `tick` on the worker's own thread;
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
use llm_governor_core::fleet::{self, grpc, ServiceCall, ServiceReply};
use llm_governor_core::headers::Headers;
use llm_governor_core::keys::{self, HashKey};
use llm_governor_core::policy::{Governor, RequestView};
use llm_governor_core::reply::STEERING_HEADER;
use llm_governor_core::worker::{Action, Effect, Failure, Lent, Reaction, Worker};
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
    /// Calls owed by no stream, by worker slot, waiting for the main thread.
    owed: Mutex<Vec<(usize, ServiceCall)>>,
    /// Those the main thread sent: (callout id, slot, seq).
    out: Mutex<Vec<(u64, usize, u32)>>,
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
    /// Streams' calls to the fleet's service in flight: (stream, callout id, seq).
    calls: Vec<(u32, u64, u32)>,
}

fn config_new(cfg: &ConfigHandle, _name: &[u8], json: &[u8]) -> Option<Arc<Module>> {
    let secret = std::env::var(keys::SECRET_ENV).ok();
    let ids = HashKey::for_envoy(
        adapters::store(),
        secret.as_deref().map(str::as_bytes),
        || HashKey::from_words(adapters::seed(), adapters::seed()),
    );
    let gov = match Governor::load(json, ids) {
        Ok(gov) => Arc::new(gov),
        Err(e) => {
            log::error!("llm_governor: {e}");
            return None;
        }
    };
    let fleet = match &gov.cfg.fleet {
        None => None,
        Some(f) => {
            // Envoy refuses a callout to a cluster it lacks at once: a health check asked of
            // the cluster now refuses a misnamed one at load, as the wasm module does.
            let probe = grpc::request_headers(grpc::HEALTH_CHECK, &f.cluster);
            let checked = cfg.main().callout(&Callout {
                cluster: &f.cluster,
                headers: &probe,
                body: &grpc::frame(&[]),
                timeout_ms: 1000,
            });
            if checked == Err(abi::CALLOUT_NO_SUCH_CLUSTER) {
                log::error!("llm_governor: {}", fleet::no_such_cluster(&f.cluster));
                return None;
            }
            let Some(scheduler) = ConfigScheduler::new(cfg) else {
                log::error!("llm_governor: fleet: Envoy gave no scheduler for the fleet's calls");
                return None;
            };
            Some(Fleet {
                cluster: f.cluster.clone(),
                scheduler,
                owed: Mutex::new(Vec::new()),
                out: Mutex::new(Vec::new()),
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
                calls: Vec::new(),
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
        paused: false,
        ended: false,
    }
}

/// Our filter of one stream.
pub struct Filter {
    module: Arc<Module>,
    slot: usize,
    id: u32,
    /// It paused at least once: it is in the slot's `paused` map and has a scheduler.
    paused: bool,
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
        if !self.reads_body(true) {
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
        let governed = self
            .slot()
            .state
            .lock()
            .is_ok_and(|st| st.worker.reads_response_headers(self.id));
        if !governed {
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
        if !self.reads_body(false) {
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
        if let Ok(mut state) = self.slot().state.lock() {
            let SlotState {
                worker,
                paused,
                calls,
            } = &mut *state;
            self.call(s, worker, paused, |w, id, lent| w.on_end(id, lent));
            // Envoy cancels the stream's calls still out as it destroys the filter, right
            // after this hook: no answer of theirs comes.
            if !calls.is_empty() {
                calls.retain(|c| c.0 != self.id);
            }
        }
        self.module.owe(self.slot);
        self.ended = true;
    }

    /// The timer thread's event: the worker's tick, each due stream's reaction applied to it.
    fn scheduled(&mut self, s: Stream) {
        let due = self.with_worker(s, |w, _, lent| w.tick(lent));
        for (id, reaction) in due.unwrap_or_default() {
            let target = if id == self.id {
                Some(s)
            } else {
                let state = self.slot().state.lock();
                state.ok().and_then(|st| st.paused.get(&id).copied())
            };
            let Some(t) = target else {
                // The stream is gone (its destroy hook ended it too): nothing to apply.
                self.with_worker(s, |w, _, lent| w.on_end(id, lent));
                continue;
            };
            if self.apply(t, id, reaction) {
                // Only a failed answer says so from a tick: let the request go on.
                t.continue_decoding();
            }
        }
        self.module.owe(self.slot);
        self.arm();
    }

    /// This stream's call to the fleet's service came back: the worker's reaction, applied.
    fn callout_done(&self, s: Stream, callout: u64, answer: &Answer) {
        let seq = self.slot().state.lock().ok().and_then(|mut st| {
            let at = st
                .calls
                .iter()
                .position(|c| c.0 == self.id && c.1 == callout)?;
            Some(st.calls.swap_remove(at).2)
        });
        let Some(seq) = seq else {
            return; // not a call of ours, or already handled
        };
        let reply = answer.reply();
        let reaction = self.with_worker(s, |w, id, lent| {
            w.on_service_answer(Some(id), seq, reply, lent)
        });
        if let Some(r) = reaction {
            if self.apply(s, self.id, r) {
                // Only a failed answer says so from outside a hook: let the request go on.
                s.continue_decoding();
            }
        }
        self.module.owe(self.slot);
        self.arm();
    }

    /// Send a call of stream `t` (id `id`) to the fleet's service.
    fn send(&self, t: Stream, id: u32, call: ServiceCall) -> Option<Failure> {
        let Some(fleet) = &self.module.fleet else {
            return Some(Failure::Call(call.seq));
        };
        let Some(callout) = fleet.send(&call, |c| t.callout(c)) else {
            return Some(Failure::Call(call.seq)); // fleet.on_error decides
        };
        if let Ok(mut st) = self.slot().state.lock() {
            st.calls.push((id, callout, call.seq));
        }
        None
    }

    /// Whether the worker has a use for this chunk of the request's (or response's) body.
    fn reads_body(&self, request: bool) -> bool {
        let state = self.slot().state.lock();
        state.is_ok_and(|st| st.worker.reads_body(self.id, request))
    }

    fn slot(&self) -> &Slot {
        &self.module.slots[self.slot]
    }

    /// Run `f` on the worker with what the host lends, the current stream being `s`; None if
    /// the worker's state is unusable (a caught panic poisoned it), which the caller treats as
    /// "go on, ungoverned".
    fn with_worker<T>(
        &self,
        s: Stream,
        f: impl FnOnce(&mut Worker, u32, &mut Lent) -> T,
    ) -> Option<T> {
        let mut state = self.slot().state.lock().ok()?;
        let SlotState { worker, paused, .. } = &mut *state;
        Some(self.call(s, worker, paused, f))
    }

    /// `f` on `worker` with the store, this stream's stats sink, the clock and the buffers of
    /// the current stream `s` (and of the paused ones, for a tick).
    fn call<T>(
        &self,
        s: Stream,
        worker: &mut Worker,
        paused: &HashMap<u32, Stream>,
        f: impl FnOnce(&mut Worker, u32, &mut Lent) -> T,
    ) -> T {
        let mut stats = self.module.stats.on(s);
        let mut io = Io {
            current: (self.id, s),
            paused,
        };
        let mut lent = Lent {
            store: adapters::store(),
            metrics: &mut stats,
            clock: &adapters::now_ms,
            io: &mut io,
        };
        f(worker, self.id, &mut lent)
    }

    /// A hook of this stream: the worker's reaction, applied; whether the stream pauses. One
    /// lock of the worker: the reaction, the stream's registration when it first pauses (a
    /// tick may address it), and when the worker next has something to do.
    fn react(
        &mut self,
        s: Stream,
        f: impl FnOnce(&mut Worker, u32, &mut Lent) -> Reaction,
    ) -> bool {
        let first_pause;
        let (reaction, next) = {
            let Ok(mut state) = self.slot().state.lock() else {
                return false;
            };
            let SlotState { worker, paused, .. } = &mut *state;
            let reaction = self.call(s, worker, paused, f);
            first_pause = reaction.action == Action::Pause && !self.paused;
            if first_pause {
                paused.insert(self.id, s);
            }
            (reaction, worker.next_due_ms())
        };
        if first_pause {
            // Its scheduler can wake the worker while it waits.
            self.paused = true;
            if let Some(scheduler) = Scheduler::new(s) {
                self.module.timer.add_waker(self.slot, self.id, scheduler);
            }
        }
        self.module.timer.arm(self.slot, next);
        !self.apply(s, self.id, reaction)
    }

    /// Tell the timer when this worker next has something to do.
    fn arm(&self) {
        let next = self
            .slot()
            .state
            .lock()
            .ok()
            .and_then(|st| st.worker.next_due_ms());
        self.module.timer.arm(self.slot, next);
    }

    /// Apply a reaction's effects in order to stream `t` (id `id`). An effect that fails is
    /// reported to the worker, whose answer replaces the rest. Returns whether it continues.
    fn apply(&self, t: Stream, id: u32, reaction: Reaction) -> bool {
        let Some(failure) = reaction
            .effects
            .into_iter()
            .find_map(|e| self.effect_call(t, id, e))
        else {
            return reaction.action == Action::Continue;
        };
        let instead = self.with_worker(t, |w, _, lent| w.failed(id, failure, lent));
        let r = instead.unwrap_or(Reaction {
            effects: Vec::new(),
            action: Action::Continue,
        });
        r.effects
            .into_iter()
            .for_each(|e| _ = self.effect_call(t, id, e));
        r.action == Action::Continue
    }

    fn effect_call(&self, t: Stream, id: u32, effect: Effect) -> Option<Failure> {
        match effect {
            Effect::CallService(call) => self.send(t, id, call),
            e => effect_call(t, e),
        }
    }
}

impl Drop for Filter {
    /// The stream's destroy hook: forget it everywhere (its end was normally handled by
    /// `complete`; Envoy's filter object is no longer ours to call, so stats are dropped).
    fn drop(&mut self) {
        if self.ended && !self.paused {
            return; // the usual stream: nothing of it is left anywhere
        }
        let id = self.id;
        if let Ok(mut st) = self.slot().state.lock() {
            let SlotState {
                worker,
                paused,
                calls,
            } = &mut *st;
            paused.remove(&id);
            // Envoy cancels the stream's calls still out with it.
            calls.retain(|c| c.0 != id);
            let mut lent = Lent {
                store: adapters::store(),
                metrics: &mut Discard,
                clock: &adapters::now_ms,
                // No stream to read from (its filter object is gone): the core's empty buffers.
                io: &mut llm_governor_core::effects::NoBodies,
            };
            worker.on_end(id, &mut lent);
        }
        self.module.owe(self.slot);
        if self.paused {
            self.module.timer.remove_waker(self.slot, id);
            self.arm();
        }
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
            log::warn!(
                "llm_governor: calling the fleet's rate-limit service on cluster {} failed ({})",
                self.cluster,
                abi::callout_refusal(*why)
            );
        })
        .ok()
    }
}

impl Module {
    /// Hand the calls worker `slot` owes to no stream (commits at streams' ends) to the main
    /// thread, which sends them for the configuration: they outlive the streams that owe them.
    fn owe(&self, slot: usize) {
        let Some(fleet) = &self.fleet else {
            return;
        };
        let owed = self.slots[slot]
            .state
            .lock()
            .map(|mut st| st.worker.take_owed())
            .unwrap_or_default();
        if owed.is_empty() {
            return;
        }
        if let Ok(mut queue) = fleet.owed.lock() {
            queue.extend(owed.into_iter().map(|c| (slot, c)));
        }
        fleet.scheduler.commit(0);
    }

    /// On the main thread: send the owed calls; one Envoy refuses is reported as failed.
    fn send_owed(&self, main: &MainThread) {
        let Some(fleet) = &self.fleet else {
            return;
        };
        let owed = fleet
            .owed
            .lock()
            .map(|mut q| std::mem::take(&mut *q))
            .unwrap_or_default();
        for (slot, call) in owed {
            match fleet.send(&call, |c| main.callout(c)) {
                Some(callout) => {
                    if let Ok(mut out) = fleet.out.lock() {
                        out.push((callout, slot, call.seq));
                    }
                }
                None => self.owed_answer(main, slot, call.seq, ServiceReply::Failed(0)),
            }
        }
    }

    /// On the main thread: an owed call came back.
    fn owed_done(&self, main: &MainThread, callout: u64, answer: &Answer) {
        let Some(fleet) = &self.fleet else {
            return;
        };
        let found = fleet.out.lock().ok().and_then(|mut out| {
            let at = out.iter().position(|c| c.0 == callout)?;
            Some(out.swap_remove(at))
        });
        if let Some((_, slot, seq)) = found {
            self.owed_answer(main, slot, seq, answer.reply());
        }
    }

    /// Tell worker `slot` what became of its owed call `seq`; its stats go through the
    /// config, as no stream is at hand on the main thread.
    fn owed_answer(&self, main: &MainThread, slot: usize, seq: u32, reply: ServiceReply) {
        let Some(s) = self.slots.get(slot) else {
            return;
        };
        if let Ok(mut st) = s.state.lock() {
            let mut lent = Lent {
                store: adapters::store(),
                metrics: &mut self.stats.on_main(main),
                clock: &adapters::now_ms,
                io: &mut llm_governor_core::effects::NoBodies,
            };
            st.worker.on_service_answer(None, seq, reply, &mut lent);
        }
    }
}

impl Answer {
    /// What the service's answer means to the core.
    fn reply(&self) -> ServiceReply<'_> {
        if !self.answered {
            return ServiceReply::Failed(grpc::UNAVAILABLE); // reset or timed out
        }
        grpc::reply(
            self.status.as_deref(),
            self.grpc_status.as_deref(),
            &self.body,
        )
    }
}

/// One effect as callbacks on stream `t`. A failed callback is logged; the failure is returned
/// when the worker must hear of it.
fn effect_call(t: Stream, effect: Effect) -> Option<Failure> {
    let (what, failure) = (effect.what(), effect.failure());
    let done = match effect {
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
        Effect::AccessLog(fields) => fields.iter().fold(true, |ok, (k, v)| {
            // The keys the wasm module's fields have (Envoy prefixes a wasm filter's with
            // `wasm.`), so one access-log format serves both modules.
            t.set_filter_state(&format!("wasm.{k}"), v) & ok
        }),
        Effect::DropRequestBody(n) => {
            // What Envoy kept so far and the chunk of this hook, if any.
            let kept = t.drain(Body::BufferedRequest, n);
            t.drain(Body::ReceivedRequest, n) | kept
        }
        Effect::SendReply(r) => {
            t.send_response(r.status, &r.headers, &r.body, "llm_governor");
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
        // Sent by `Filter::send` (it needs the module's way to the service).
        Effect::CallService(_) => return failure,
    };
    if done {
        return None;
    }
    log::warn!("llm_governor: {what} failed");
    failure
}
