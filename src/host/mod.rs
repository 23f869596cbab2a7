//! The proxy-wasm host: the only code that names proxy_wasm. Each callback becomes a call of the
//! core's `protocol` (which runs the `Worker` and applies its reactions), over `Host`: the
//! worker of this VM and hostcalls. Every hostcall error is a value; nothing here unwraps, and
//! nothing here decides.

mod abi;
mod adapters;

use adapters::{HostLogger, HostStats, HostStore};
use llm_governor_core::effects::{from_upstream, Direction, Lent, StreamIo};
use llm_governor_core::fleet::grpc::{self, ServiceCall};
use llm_governor_core::headers::Headers;
use llm_governor_core::metrics::{Catalogue, Sink};
use llm_governor_core::protocol::{self, Host, StreamOps};
use llm_governor_core::reply::LocalReply;
use llm_governor_core::request::RequestView;
use llm_governor_core::worker::{self, Worker};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

proxy_wasm::main! {{
    let _ = log::set_logger(&HostLogger);
    log::set_max_level(log::LevelFilter::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root { id, vm: None }) });
}}

/// What one VM (one worker thread) shares between its root and stream contexts.
struct Vm {
    worker: RefCell<Worker>,
    stats: Catalogue<u32>,
    /// The tick period set now, in ms (0: no tick).
    ticking: Cell<u32>,
    /// The root context's id: calls that outlive a stream are sent from it.
    root: u32,
    /// The fleet's cluster, when fleet limits are configured.
    cluster: String,
}

impl Host for Vm {
    type Stream = Effective;

    fn with_worker<T>(
        &self,
        current: Option<u32>,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> Option<T> {
        let mut worker = self.worker.try_borrow_mut().ok()?;
        let mut lent = Lent {
            store: &HostStore,
            metrics: &mut Sink {
                catalogue: &self.stats,
                writer: HostStats,
            },
            clock: &abi::now_ms,
            io: &mut HostIo(current),
        };
        Some(f(&mut worker, &mut lent))
    }

    fn current(&self, _id: u32) -> Effective {
        Effective
    }

    /// The effective context is reset per VM call: set for every stream addressed.
    fn stream(&self, id: u32) -> Option<Effective> {
        abi::set_effective_context(id).ok().map(|()| Effective)
    }

    /// A stream's call is sent on its context (Envoy cancels it with the stream); an owed one
    /// from the root's, which outlives every stream.
    fn send(&self, stream: Option<&Effective>, call: &ServiceCall) -> Option<u64> {
        if stream.is_none() && abi::set_effective_context(self.root).is_err() {
            return None;
        }
        let (service, method) = (call.method.service(), call.method.name());
        let token = abi::grpc_call(
            &self.cluster,
            service,
            method,
            &call.message,
            call.timeout_ms,
        );
        token.map(u64::from).ok()
    }
}

/// The stream of the effective context, as hostcalls.
struct Effective;

impl StreamOps for Effective {
    fn request_header(&self, name: &str, value: Option<&str>) -> bool {
        let map = MapType::HttpRequestHeaders;
        match value {
            Some(v) => abi::replace_header(map, name, v).is_ok(),
            None => abi::remove_header(map, name).is_ok(),
        }
    }

    fn response_header(&self, name: &str, value: &str) -> bool {
        abi::replace_header(MapType::HttpResponseHeaders, name, value).is_ok()
    }

    fn filter_state(&self, key: &str, value: &str) -> bool {
        abi::set_property(&[key], value.as_bytes()).is_ok()
    }

    fn drop_request_body(&self, n: usize) -> bool {
        abi::set_buffer(BufferType::HttpRequestBody, 0, n, &[]).is_ok()
    }

    fn send_reply(&self, r: &LocalReply) -> bool {
        abi::send_local_response(r.status, r.details, &r.headers, &r.body).is_ok()
    }

    fn resume(&self, direction: Direction) -> bool {
        match direction {
            Direction::Request => abi::resume_request().is_ok(),
            Direction::Response => abi::resume_response().is_ok(),
        }
    }
}

impl Vm {
    /// A worker ticks only while it holds, waits for or watches something, as often as that
    /// needs (`Worker::tick_ms`).
    fn tick_as_needed(&self) {
        let Ok(period) = self.worker.try_borrow().map(|w| w.tick_ms().unwrap_or(0)) else {
            return; // mid-callback: the callback's end looks again
        };
        let period = u32::try_from(period).unwrap_or(u32::MAX);
        if period != self.ticking.get() && abi::set_tick_period_ms(period).is_ok() {
            self.ticking.set(period);
        }
    }

    fn callback(
        &self,
        id: u32,
        f: impl FnOnce(&mut Worker, u32, &mut Lent) -> worker::Reaction,
    ) -> Action {
        let action = protocol::callback(self, id, f);
        self.tick_as_needed();
        match action {
            worker::Action::Continue => Action::Continue,
            worker::Action::Pause => Action::Pause,
        }
    }

    /// Envoy delivered what became of a call (`status` 0: answered, `size` bytes).
    fn call_done(&self, stream: Option<u32>, token: u32, status: u32, size: usize) {
        // An answer of 0 bytes is a message whose fields are all defaults (a CommitResponse
        // that released nothing): there is no buffer to read for it.
        let read = || match size {
            0 => Some(Vec::new()),
            _ => abi::buffer(BufferType::GrpcReceiveBuffer, 0, size).ok(),
        };
        let bytes = (status == 0).then(read).flatten();
        let reply = grpc::delivered(status, bytes.as_deref());
        // A call a stream's reaction sent from a tick is answered on the root context.
        let token = u64::from(token);
        let on_root = stream.is_none();
        let owner = || self.worker.try_borrow_mut().ok()?.calls().stream_of(token);
        let stream = stream.or_else(owner);
        protocol::call_done(self, stream, token, reply);
        if on_root {
            // What an owed call's answer owes goes at once (a slot's renewal, a turn taken
            // again), not at the next tick: from the root context, whose answers outlive every
            // stream (a call sent from a stream's context is answered to that stream).
            protocol::send_owed(self);
        }
        self.tick_as_needed();
    }
}

/// Stream buffers and properties, read on the effective context: the current stream's in a
/// callback, another's (set first) in a tick.
struct HostIo(Option<u32>);

impl HostIo {
    fn focus(&self, id: u32) -> bool {
        self.0 == Some(id) || abi::set_effective_context(id).is_ok()
    }

    fn body(&self, id: u32, kind: BufferType, max: usize) -> Vec<u8> {
        let read = self.focus(id).then(|| abi::buffer(kind, 0, max).ok());
        read.flatten().unwrap_or_default()
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
        let read = || {
            abi::get_property(&["response", "code_details"])
                .ok()
                .flatten()
        };
        let details = self.focus(id).then(read).flatten();
        from_upstream(details.as_deref())
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
            .inspect(|vm| vm.call_done(None, token, status, size));
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let exists = |cluster: &str| {
            let (service, method) = (grpc::HEALTH_SERVICE, grpc::HEALTH_METHOD);
            abi::grpc_call(cluster, service, method, &[], grpc::HEALTH_CHECK_TIMEOUT_MS).is_ok()
        };
        let loaded = abi::buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .map_err(|e| format!("could not read the plugin configuration: {e:?}"))
            .and_then(|json| protocol::load(&json, adapters::hash_key(), exists));
        let gov = match loaded {
            Ok(gov) => gov,
            Err(e) => {
                log::error!("llm_governor: {e}");
                return false;
            }
        };
        let cluster = gov.cfg.fleet.as_ref().map(|f| f.cluster.clone());
        self.vm = Some(Rc::new(Vm {
            stats: adapters::define_stats(&gov.cfg),
            worker: RefCell::new(Worker::new(Arc::new(gov), adapters::seed())),
            ticking: Cell::new(0),
            root: self.id,
            cluster: cluster.unwrap_or_default(),
        }));
        // A worker that watches the fleet's cooldowns ticks from now on (`fleet::watch`).
        if let Some(vm) = &self.vm {
            vm.tick_as_needed();
        }
        true
    }

    fn on_tick(&mut self) {
        if let Some(vm) = &self.vm {
            protocol::tick(&**vm);
            protocol::send_owed(&**vm);
            vm.tick_as_needed();
        }
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
        protocol::end(&*self.vm, self.id);
        self.vm.tick_as_needed();
    }
}

impl Context for Filter {
    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        self.vm.call_done(Some(self.id), token, status, size);
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
        let governed = self.vm.worker.try_borrow();
        if !governed.is_ok_and(|w| w.reads_response_headers(self.id)) {
            return Action::Continue; // no hostcall for the map of a stream nothing governs
        }
        let pairs = abi::header_map(MapType::HttpResponseHeaders).unwrap_or_default();
        let headers = Headers::wire(&pairs);
        self.vm.callback(self.id, |w, id, lent| {
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
