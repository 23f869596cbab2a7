//! The proxy-wasm host: the only code that names proxy_wasm. Each callback becomes a call into
//! the core's `Worker`, and the `Reaction` it returns becomes hostcalls. Every hostcall error is
//! a value; nothing here unwraps, and nothing here decides.

mod abi;
mod adapters;

use adapters::{HostLogger, HostMetrics, HostStore};
use llm_governor_core::fleet::{self, ServiceCall, ServiceReply};
use llm_governor_core::headers::Headers;
use llm_governor_core::policy::{Governor, RequestView};
use llm_governor_core::reply::STEERING_HEADER;
use llm_governor_core::worker::{self, Effect, Failure, Lent, Reaction, StreamIo, Worker};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

/// How often a worker that holds or waits for something looks at it: the release precision of
/// a hold (proxy-wasm has one periodic tick per VM, not a timer per wait).
const TICK_MS: u32 = 20;

proxy_wasm::main! {{
    let _ = log::set_logger(&HostLogger);
    log::set_max_level(log::LevelFilter::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root { id, vm: None }) });
}}

/// What one VM (one worker thread) shares between its root and stream contexts.
struct Vm {
    worker: RefCell<Worker>,
    metrics: RefCell<HostMetrics>,
    ticking: Cell<bool>,
    /// The root context's id: calls that outlive a stream are sent from it.
    root: u32,
    /// The fleet's cluster, when fleet limits are configured.
    cluster: Option<String>,
    /// Calls out: (Envoy's token, the stream or none for a call owed by no stream, the
    /// worker's sequence number). A few at a time: a list.
    calls: RefCell<Vec<(u32, Option<u32>, u32)>>,
}

impl Vm {
    /// Run `f` on the worker with what the host lends; None if the worker is busy (a hostcall
    /// re-entered the VM), which the caller treats as "go on, ungoverned".
    fn with_worker<T>(
        &self,
        current: Option<u32>,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> Option<T> {
        let mut worker = self.worker.try_borrow_mut().ok()?;
        let mut metrics = self.metrics.try_borrow_mut().ok()?;
        let mut io = HostIo(current);
        let mut lent = Lent {
            store: &HostStore,
            metrics: &mut *metrics,
            clock: &abi::now_ms,
            io: &mut io,
        };
        Some(f(&mut worker, &mut lent))
    }

    /// A callback of stream `id`: the worker's reaction, applied; the action for Envoy.
    fn callback(&self, id: u32, f: impl FnOnce(&mut Worker, u32, &mut Lent) -> Reaction) -> Action {
        let action = match self.with_worker(Some(id), |w, lent| f(w, id, lent)) {
            Some(reaction) => self.apply(id, reaction),
            None => Action::Continue,
        };
        self.tick_as_needed();
        action
    }

    /// Apply a reaction's effects in order. An effect that fails is reported to the worker,
    /// whose answer replaces the rest (and is applied without further reports).
    fn apply(&self, id: u32, reaction: Reaction) -> Action {
        let Some(failure) = reaction
            .effects
            .into_iter()
            .find_map(|e| self.effect_call(id, e))
        else {
            return action(reaction.action);
        };
        let instead = self.with_worker(Some(id), |w, lent| w.failed(id, failure, lent));
        let r = instead.unwrap_or(Reaction {
            effects: Vec::new(),
            action: worker::Action::Continue,
        });
        r.effects
            .into_iter()
            .for_each(|e| _ = self.effect_call(id, e));
        action(r.action)
    }

    /// Apply a reaction that comes outside stream `id`'s own callback (a tick, an answer of
    /// the fleet's service), on its effective context.
    fn apply_later(&self, id: u32, reaction: Reaction) {
        // The effective context is reset per VM call: set it for every stream.
        if abi::set_effective_context(id).is_err() {
            self.with_worker(None, |w, lent| w.on_end(id, lent)); // the stream is gone
            return;
        }
        if self.apply(id, reaction) == Action::Continue {
            // Only a failed answer says so from outside a callback: let the request go on.
            let _ = abi::resume_request();
        }
    }

    /// One effect as hostcalls (on the effective context). A failed hostcall is logged; the
    /// failure is returned when the worker must hear of it.
    fn effect_call(&self, id: u32, effect: Effect) -> Option<Failure> {
        if let Effect::CallService(call) = effect {
            return self.send(Some(id), call).err();
        }
        effect_call(effect)
    }

    /// Send a call to the fleet's service (on the effective context: a stream's call is
    /// cancelled with its stream, a call sent from the root outlives every stream).
    fn send(&self, stream: Option<u32>, call: ServiceCall) -> Result<(), Failure> {
        let cluster = self.cluster.as_deref().unwrap_or("");
        let m = call.method;
        match abi::grpc_call(
            cluster,
            m.service(),
            m.name(),
            &call.message,
            call.timeout_ms,
        ) {
            Ok(token) => {
                if let Ok(mut calls) = self.calls.try_borrow_mut() {
                    calls.push((token, stream, call.seq));
                }
                Ok(())
            }
            Err(e) => {
                log::warn!("llm_governor: calling the fleet's rate-limit service failed: {e:?}");
                Err(Failure::Call(call.seq))
            }
        }
    }

    /// Envoy delivered what became of a call (`status` 0: answered, `size` bytes). One copy
    /// for the root's and the streams' callbacks.
    #[inline(never)]
    fn on_service_answer(&self, token: u32, status: u32, size: usize) {
        let found = self.calls.try_borrow_mut().ok().and_then(|mut calls| {
            let at = calls.iter().position(|c| c.0 == token)?;
            let (_, stream, seq) = calls.swap_remove(at);
            Some((stream, seq))
        });
        let Some((stream, seq)) = found else {
            return; // not ours (the load-time check of the cluster), or already handled
        };
        let bytes = match status {
            0 => abi::buffer(BufferType::GrpcReceiveBuffer, 0, size).ok(),
            _ => None,
        };
        let reply = match (status, &bytes) {
            (0, Some(b)) => ServiceReply::Message(b),
            (0, None) => ServiceReply::Failed(2), // unreadable: as UNKNOWN
            (s, _) => ServiceReply::Failed(s),
        };
        let reaction = self.with_worker(stream, |w, lent| {
            w.on_service_answer(stream, seq, reply, lent)
        });
        if let (Some(id), Some(r)) = (stream, reaction) {
            self.apply_later(id, r);
        }
        self.tick_as_needed();
    }

    /// Send the calls owed by no stream, from the root (they outlive the streams that owed
    /// them); one that cannot be sent is reported as failed.
    fn send_owed(&self) {
        let owed = self
            .with_worker(None, |w, _| w.take_owed())
            .unwrap_or_default();
        if owed.is_empty() || abi::set_effective_context(self.root).is_err() {
            return;
        }
        for call in owed {
            let seq = call.seq;
            if self.send(None, call).is_err() {
                self.with_worker(None, |w, lent| {
                    w.on_service_answer(None, seq, ServiceReply::Failed(0), lent)
                });
            }
        }
    }

    /// The stream is over: calls still out for it are cancelled by Envoy with it.
    fn forget_calls(&self, id: u32) {
        if let Ok(mut calls) = self.calls.try_borrow_mut() {
            if !calls.is_empty() {
                calls.retain(|c| c.1 != Some(id));
            }
        }
    }

    /// A worker ticks only while it holds or waits for something.
    fn tick_as_needed(&self) {
        let busy = self.worker.try_borrow().is_ok_and(|w| !w.is_idle());
        let period = if busy { TICK_MS } else { 0 };
        if busy != self.ticking.get() && abi::set_tick_period_ms(period).is_ok() {
            self.ticking.set(busy);
        }
    }

    fn on_tick(&self) {
        let due = self.with_worker(None, |w, lent| w.tick(lent));
        for (id, reaction) in due.unwrap_or_default() {
            self.apply_later(id, reaction);
        }
        self.send_owed();
        self.tick_as_needed();
    }
}

fn action(a: worker::Action) -> Action {
    match a {
        worker::Action::Continue => Action::Continue,
        worker::Action::Pause => Action::Pause,
    }
}

/// One effect as hostcalls (on the effective context). A failed hostcall is logged; the
/// failure is returned when the worker must hear of it.
fn effect_call(effect: Effect) -> Option<Failure> {
    let (req, resp) = (MapType::HttpRequestHeaders, MapType::HttpResponseHeaders);
    let (what, failure) = (effect.what(), effect.failure());
    let done = match effect {
        Effect::StripSteeringHeader => abi::remove_header(req, STEERING_HEADER),
        Effect::Steer(pool) => abi::replace_header(req, STEERING_HEADER, &pool),
        Effect::SetResponseHeaders(hs) => {
            every(hs.iter().map(|(n, v)| abi::replace_header(resp, n, v)))
        }
        Effect::AccessLog(f) => every(f.iter().map(|(k, v)| abi::set_property(&[k], v.as_bytes()))),
        Effect::DropRequestBody(n) => abi::set_buffer(BufferType::HttpRequestBody, 0, n, &[]),
        Effect::SendReply(r) => abi::send_local_response(r.status, &r.headers, &r.body),
        Effect::ResumeRequest => abi::resume_request(),
        Effect::ResumeResponse => abi::resume_response(),
        // Sent by `Vm::effect_call`, which knows the cluster and keeps the token.
        Effect::CallService(_) => Ok(()),
    };
    let e = done.err()?;
    log::warn!("llm_governor: {what} failed: {e:?}");
    failure
}

/// Every call made (none stops the rest), the last failure kept.
fn every(calls: impl Iterator<Item = abi::HostResult<()>>) -> abi::HostResult<()> {
    calls.filter_map(Result::err).last().map_or(Ok(()), Err)
}

/// Stream buffers and properties, read on the effective context: the current stream's in a
/// callback, another's (set first) in a tick.
struct HostIo(Option<u32>);

impl HostIo {
    fn focus(&self, id: u32) -> bool {
        self.0 == Some(id) || abi::set_effective_context(id).is_ok()
    }

    fn body(&self, id: u32, kind: BufferType, max: usize) -> Vec<u8> {
        let read = self
            .focus(id)
            .then(|| abi::buffer(kind, 0, max).ok())
            .flatten();
        read.unwrap_or_default()
    }
}

impl StreamIo for HostIo {
    fn request_body(&mut self, id: u32, max: usize) -> Vec<u8> {
        self.body(id, BufferType::HttpRequestBody, max)
    }

    fn response_body(&mut self, id: u32, max: usize) -> Vec<u8> {
        self.body(id, BufferType::HttpResponseBody, max)
    }

    fn answered_by_upstream(&mut self, id: u32) -> bool {
        if !self.focus(id) {
            return true;
        }
        match abi::get_property(&["response", "code_details"]) {
            Ok(Some(details)) => details == b"via_upstream",
            _ => true,
        }
    }
}

struct Root {
    id: u32,
    vm: Option<Rc<Vm>>,
}

impl Context for Root {
    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        self.vm
            .as_ref()
            .inspect(|vm| vm.on_service_answer(token, status, size));
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let loaded = abi::buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .map_err(|e| format!("could not read the plugin configuration: {e:?}"))
            .and_then(|json| Governor::load(&json, adapters::hash_key()));
        let gov = match loaded {
            Ok(gov) => gov,
            Err(e) => {
                log::error!("llm_governor: {e}");
                return false;
            }
        };
        let cluster = gov.cfg.fleet.as_ref().map(|f| f.cluster.clone());
        if let Some(c) = &cluster {
            // Envoy refuses a call to a cluster it does not have: ask once, now, so a wrong
            // name is refused at load rather than failing every request. The probe is a gRPC
            // health check; its answer is not read.
            let probe = abi::grpc_call(c, "grpc.health.v1.Health", "Check", &[], 1000);
            if probe.is_err() {
                log::error!("llm_governor: {}", fleet::no_such_cluster(c));
                return false;
            }
        }
        let metrics = RefCell::new(HostMetrics::define(&gov.cfg));
        let worker = RefCell::new(Worker::new(Arc::new(gov), adapters::seed()));
        let ticking = Cell::new(false);
        self.vm = Some(Rc::new(Vm {
            worker,
            metrics,
            ticking,
            root: self.id,
            cluster,
            calls: RefCell::new(Vec::new()),
        }));
        true
    }

    fn on_tick(&mut self) {
        self.vm.as_ref().inspect(|vm| vm.on_tick());
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let vm = self.vm.clone()?;
        Some(Box::new(Filter { vm, id: context_id }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter {
    vm: Rc<Vm>,
    id: u32,
}

impl Filter {
    /// The stream is over (complete, reset or cancelled), or its context is going away.
    fn end(&self) {
        let id = self.id;
        self.vm.with_worker(Some(id), |w, lent| w.on_end(id, lent));
        self.vm.forget_calls(id);
        self.vm.tick_as_needed();
    }
}

impl Context for Filter {
    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        self.vm.on_service_answer(token, status, size);
    }
}

impl Drop for Filter {
    fn drop(&mut self) {
        self.end();
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let pairs = abi::header_map(MapType::HttpRequestHeaders).unwrap_or_default();
        let view = RequestView::of(Headers::wire(&pairs));
        self.vm.callback(self.id, |w, id, lent| {
            w.on_request_headers(id, &view, end_of_stream, lent)
        })
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.vm.callback(self.id, |w, id, lent| {
            w.on_request_body(id, body_size, end_of_stream, lent)
        })
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.vm
            .callback(self.id, |w, id, lent| w.on_request_trailers(id, lent))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let id = self.id;
        let governed = self
            .vm
            .worker
            .try_borrow()
            .is_ok_and(|w| w.reads_response_headers(id));
        if !governed {
            return Action::Continue; // no hostcall for the map of a stream nothing governs
        }
        let pairs = abi::header_map(MapType::HttpResponseHeaders).unwrap_or_default();
        let headers = Headers::wire(&pairs);
        self.vm.callback(id, |w, id, lent| {
            w.on_response_headers(id, &headers, end_of_stream, lent)
        })
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.vm.callback(self.id, |w, id, lent| {
            w.on_response_body(id, body_size, end_of_stream, lent)
        })
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.vm
            .callback(self.id, |w, id, lent| w.on_response_trailers(id, lent))
    }

    fn on_log(&mut self) {
        self.end();
    }
}
