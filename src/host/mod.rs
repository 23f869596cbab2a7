//! The thin host layer: the only code that names proxy_wasm. It reads what Envoy hands over,
//! asks the pure policy what to do, and applies the answer. Every hostcall error is a value;
//! nothing here unwraps.

mod abi;
mod adapters;

use llm_governor_core::classify;
use llm_governor_core::config;
use llm_governor_core::deadline;
use llm_governor_core::estimate;
use llm_governor_core::headers::{Headers, WireHeaders};
use llm_governor_core::hold::{Holds, Release, Step};
use llm_governor_core::metrics::Counter;
use llm_governor_core::policy::{
    Clock, Env, Flow, Governor, RequestView, ResponseStep, STEERING_HEADER as POOL_HEADER,
};
use llm_governor_core::reply::{LocalReply, HELD_MS_HEADER};
use llm_governor_core::usage::UsageScanner;
use adapters::{HostLogger, HostMetrics, HostRandom, HostStore};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// Error bodies are small; past this much, classify from what arrived.
const MAX_ERROR_BODY: usize = 16 * 1024;
/// How long a held response waits for its body before it is classified without one.
const BODY_WAIT_MS: u64 = 1000;
/// How long a local answer waits for the end of the request body before it is sent anyway (a
/// slow upload then gets its answer early, on a connection Envoy closes); and how long a
/// request whose body is read before admission (a token limit reserves) waits for it before
/// it is estimated from what arrived.
const REQUEST_BODY_WAIT_MS: u64 = 10_000;
/// After a body never came, how long to stop holding responses (Envoy is evidently configured
/// without `allow_on_headers_stop_iteration`), before trying again.
const HEADERS_ONLY_FOR_MS: u64 = 60_000;
/// How often a worker that holds something looks at it: the release precision of a hold.
const TICK_MS: u32 = 20;

proxy_wasm::main! {{
    let _ = log::set_logger(&HostLogger);
    log::set_max_level(log::LevelFilter::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { shared: None }) });
}}

/// What a paused stream is waiting for, each with its own deadline and its own consequence
/// when the deadline passes. (Requests held through a cooldown, a bucket or a cap are in
/// `Holds`, the pure state machine.)
enum Wait {
    /// An upstream error response waiting for its body to be classified. Overdue: classify
    /// from what was buffered, or, when nothing arrived, from status and headers (and stop
    /// holding responses on this worker for a while: body callbacks are evidently not coming).
    ResponseBody {
        flow: Flow,
        status: u16,
        headers: WireHeaders,
        until_ms: u64,
    },
    /// A local answer waiting for the end of the request body: answering before the body has
    /// been read makes Envoy close an HTTP/1.1 connection, and every local 429 would then cost
    /// the client a new connection (and TLS handshake). Overdue: answer anyway.
    RequestBodyEnd { reply: LocalReply, until_ms: u64 },
    /// A request whose body is read before admission (a limit reserves tokens or keys by
    /// model), waiting for its end or the first `estimate::MAX_BODY` bytes. Overdue: admit it
    /// on what arrived.
    RequestBody(BodyRead),
}

/// A request paused for its body: its flow, hold budget and declared length, and whether
/// any of the body has reached the filter (until then it waits `BODY_WAIT_MS`: without
/// `allow_on_headers_stop_iteration` Envoy delivers none).
struct BodyRead {
    flow: Flow,
    budget_ms: u64,
    content_length: usize,
    until_ms: u64,
    seen: bool,
}

impl Wait {
    fn until_ms(&self) -> u64 {
        match self {
            Wait::ResponseBody { until_ms, .. }
            | Wait::RequestBodyEnd { until_ms, .. }
            | Wait::RequestBody(BodyRead { until_ms, .. }) => *until_ms,
        }
    }
}

/// What one VM (one worker thread) shares between its root and stream contexts.
struct Shared {
    governor: Governor,
    metrics: RefCell<HostMetrics>,
    rng: RefCell<HostRandom>,
    waits: RefCell<HashMap<u32, Wait>>,
    holds: RefCell<Holds>,
    /// Requests held now (in `holds`), and whether their request body has ended.
    held: RefCell<HashMap<u32, bool>>,
    /// Flows the root context handed back (held requests the tick let go, responses it
    /// classified), for their stream to pick up.
    released: RefCell<HashMap<u32, Flow>>,
    /// Until when to classify 429s from headers only (body callbacks evidently not coming).
    headers_only_until: Cell<u64>,
    warned_body_unavailable: Cell<bool>,
    ticking: Cell<bool>,
}

impl Shared {
    /// Run a policy call with the host's store, metrics and randomness at `now_ms` (read once
    /// per callback: every hostcall crosses the V8 boundary).
    fn with_env<T>(&self, now_ms: u64, f: impl FnOnce(&Governor, &mut Env) -> T) -> Option<T> {
        self.with_clock(Clock::At(now_ms), f)
    }

    /// `with_env` with a clock the policy reads only if it needs the time.
    fn with_clock<T>(&self, clock: Clock, f: impl FnOnce(&Governor, &mut Env) -> T) -> Option<T> {
        let mut metrics = self.metrics.try_borrow_mut().ok()?;
        let mut rng = self.rng.try_borrow_mut().ok()?;
        let mut env = Env {
            store: &HostStore,
            metrics: &mut *metrics,
            rng: &mut *rng,
            clock,
        };
        Some(f(&self.governor, &mut env))
    }

    fn wait(&self, context_id: u32, wait: Wait) {
        if let Ok(mut map) = self.waits.try_borrow_mut() {
            map.insert(context_id, wait);
        }
        self.tick_as_needed();
    }

    fn take_wait(&self, context_id: u32) -> Option<Wait> {
        self.waits.try_borrow_mut().ok()?.remove(&context_id)
    }

    fn take_body_read(&self, context_id: u32) -> Option<BodyRead> {
        let mut map = self.waits.try_borrow_mut().ok()?;
        match map.remove(&context_id)? {
            Wait::RequestBody(read) => Some(read),
            other => {
                map.insert(context_id, other);
                None
            }
        }
    }

    /// Admit a request whose body was read: estimate it from the first `estimate::MAX_BODY`
    /// bytes Envoy buffered (`body_size` in all so far, when a body callback said; else what
    /// the buffer holds), then the same step as any request.
    fn admit_read(
        &self,
        id: u32,
        read: BodyRead,
        body_size: Option<usize>,
        now: u64,
    ) -> Option<Step> {
        let bound = body_size
            .unwrap_or(estimate::MAX_BODY)
            .min(estimate::MAX_BODY);
        let prefix = abi::buffer(BufferType::HttpRequestBody, 0, bound).unwrap_or_default();
        let total = body_size.unwrap_or(prefix.len()).max(read.content_length);
        let BodyRead {
            mut flow,
            budget_ms,
            ..
        } = read;
        self.with_env(now, |g, env| {
            g.on_request_body(&mut flow, &prefix, total);
            match self.holds.try_borrow_mut() {
                Ok(mut holds) => holds.request(g, flow, budget_ms, id, env),
                Err(_) => Step::Go(flow),
            }
        })
    }

    /// Whether the request's body is still being read; the first part of it to arrive gives
    /// the rest `REQUEST_BODY_WAIT_MS`.
    fn is_reading_body(&self, context_id: u32, now: u64) -> bool {
        let Ok(mut map) = self.waits.try_borrow_mut() else {
            return false;
        };
        match map.get_mut(&context_id) {
            Some(Wait::RequestBody(read)) => {
                if !std::mem::replace(&mut read.seen, true) {
                    read.until_ms = now + REQUEST_BODY_WAIT_MS;
                }
                true
            }
            _ => false,
        }
    }

    fn is_waiting_for_request_body(&self, context_id: u32) -> bool {
        self.waits
            .try_borrow()
            .is_ok_and(|m| matches!(m.get(&context_id), Some(Wait::RequestBodyEnd { .. })))
    }

    fn is_waiting_for_response_body(&self, context_id: u32) -> bool {
        self.waits
            .try_borrow()
            .is_ok_and(|m| matches!(m.get(&context_id), Some(Wait::ResponseBody { .. })))
    }

    fn mark_held(&self, id: u32, body_done: bool) {
        if let Ok(mut m) = self.held.try_borrow_mut() {
            m.insert(id, body_done);
        }
    }

    fn is_held(&self, id: u32) -> bool {
        self.held.try_borrow().is_ok_and(|m| m.contains_key(&id))
    }

    /// A held request's body (or trailers) ended.
    fn held_body_ended(&self, id: u32) {
        if let Ok(mut m) = self.held.try_borrow_mut() {
            if let Some(done) = m.get_mut(&id) {
                *done = true;
            }
        }
    }

    /// It is no longer held: whether its request body had ended.
    fn unhold(&self, id: u32) -> bool {
        self.held
            .try_borrow_mut()
            .ok()
            .and_then(|mut m| m.remove(&id))
            .unwrap_or(false)
    }

    /// A worker ticks only while it holds or waits for something.
    fn tick_as_needed(&self) {
        let busy = self.waits.try_borrow().is_ok_and(|m| !m.is_empty())
            || self.holds.try_borrow().is_ok_and(|h| !h.is_empty());
        if busy != self.ticking.get() {
            let period = if busy { TICK_MS } else { 0 };
            if abi::set_tick_period_ms(period).is_ok() {
                self.ticking.set(busy);
            }
        }
    }

    /// Body callbacks are known to work on this worker (or it is time to try again).
    fn body_callbacks_expected(&self, now: impl FnOnce() -> u64) -> bool {
        let until = self.headers_only_until.get();
        until == 0 || now() >= until
    }

    /// Classify a held response from `body` (empty when none came) and set its headers.
    fn classify_held(&self, flow: &mut Flow, status: u16, headers: &WireHeaders, body: &[u8]) {
        let governed = self
            .with_env(abi::now_ms(), |g, env| {
                g.on_response_body(flow, status, &Headers::wire(headers), body, env)
            })
            .flatten();
        if let Some(g) = governed {
            apply(&g.headers);
        }
    }

    /// Waits whose deadline passed: let each go with its own consequence.
    fn release_overdue(&self, now: u64) {
        let overdue: Vec<(u32, Wait)> = match self.waits.try_borrow_mut() {
            Ok(mut map) => {
                let ids: Vec<u32> = map
                    .iter()
                    .filter(|(_, w)| w.until_ms() <= now)
                    .map(|(id, _)| *id)
                    .collect();
                ids.into_iter()
                    .filter_map(|id| map.remove(&id).map(|w| (id, w)))
                    .collect()
            }
            Err(_) => return,
        };
        for (id, wait) in overdue {
            if abi::set_effective_context(id).is_err() {
                continue; // the stream is gone
            }
            match wait {
                Wait::ResponseBody {
                    mut flow,
                    status,
                    headers,
                    ..
                } => {
                    let body = buffered_error_body();
                    if body.is_empty() {
                        self.body_never_came(&flow, now);
                    }
                    self.classify_held(&mut flow, status, &headers, &body);
                    if let Ok(mut m) = self.released.try_borrow_mut() {
                        m.insert(id, flow);
                    }
                    if let Err(e) = abi::resume_response() {
                        log::warn!("llm_governor: could not resume a held response: {e}");
                    }
                }
                Wait::RequestBodyEnd { reply, .. } => {
                    send_reply(&reply);
                }
                Wait::RequestBody(read) => {
                    // The body is slow, or body callbacks never come: admit on what arrived.
                    if !read.seen {
                        self.body_never_came(&read.flow, now);
                    }
                    match self.admit_read(id, read, None, now) {
                        Some(Step::Go(flow)) => self.resume(id, flow, now),
                        Some(Step::Held) => self.mark_held(id, false),
                        Some(Step::Reply(_, reply)) => {
                            record_for_access_log(&reply.headers);
                            send_reply(&reply);
                        }
                        None => {
                            let _ = abi::resume_request();
                        }
                    }
                }
            }
        }
    }

    /// Let a paused request go upstream (steered first: Envoy releases the headers after the
    /// resume), handing its flow to its stream; if the stream is gone, give back what it took.
    /// The stream must be the effective context.
    fn resume(&self, id: u32, mut flow: Flow, now: u64) {
        steer(&self.governor, &flow);
        let resumed = abi::resume_request()
            .map_err(|e| log::warn!("llm_governor: could not resume a held request: {e}"))
            .is_ok();
        if resumed {
            if let Ok(mut m) = self.released.try_borrow_mut() {
                m.insert(id, flow);
            }
        } else {
            self.with_env(now, |g, env| g.on_stream_end(&mut flow, None, env));
        }
    }

    fn body_never_came(&self, flow: &Flow, now: u64) {
        self.headers_only_until.set(now + HEADERS_ONLY_FOR_MS);
        self.with_env(now, |_, env| {
            env.metrics.count(flow.pool, Counter::BodyUnavailable)
        });
        if !self.warned_body_unavailable.replace(true) {
            log::warn!(
                "llm_governor: a held body never arrived; for a minute, errors are classified from \
                 status and headers alone and token limits charge after the response instead of \
                 reserving. Set allow_on_headers_stop_iteration: true in the wasm plugin config so \
                 quota errors can be told from rate limits and requests can be estimated"
            );
        }
    }

    /// Held requests whose gates opened go upstream; those whose wait outgrew their limit are
    /// answered locally.
    fn release_held(&self, now: u64) {
        let releases = {
            let Ok(mut holds) = self.holds.try_borrow_mut() else {
                return;
            };
            if holds.is_empty() {
                return;
            }
            self.with_env(now, |g, env| holds.tick(g, env))
                .unwrap_or_default()
        };
        for release in releases {
            let id = match &release {
                Release::Go { id, .. } | Release::Reply { id, .. } => *id,
            };
            let body_done = self.unhold(id);
            match release {
                Release::Go { id, mut flow } => {
                    // The effective context is reset per VM call: set it for every stream.
                    if abi::set_effective_context(id).is_ok() {
                        self.resume(id, flow, now);
                    } else {
                        // The stream is gone: give back what it took.
                        self.with_env(now, |g, env| g.on_stream_end(&mut flow, None, env));
                    }
                }
                Release::Reply { id, reply, .. } => {
                    if abi::set_effective_context(id).is_err() {
                        continue;
                    }
                    record_for_access_log(&reply.headers);
                    if body_done || !self.body_callbacks_expected(|| now) {
                        send_reply(&reply);
                    } else {
                        self.wait(
                            id,
                            Wait::RequestBodyEnd {
                                reply,
                                until_ms: now + REQUEST_BODY_WAIT_MS,
                            },
                        );
                    }
                }
            }
        }
    }
}

/// Name the fallback pool of a steered request in its headers, before the router runs (a wasm
/// header change clears Envoy's route cache, so the route is selected again).
fn steer(governor: &Governor, flow: &Flow) {
    if let Some(name) = governor.steered_to(flow) {
        if let Err(e) = abi::replace_header(MapType::HttpRequestHeaders, POOL_HEADER, name) {
            log::warn!("llm_governor: could not steer a request to pool {name}: {e}");
        }
    }
}

/// Whether the current response came from the upstream (`response.code_details` is
/// `via_upstream`) rather than from Envoy itself. Unknown counts as upstream, as before.
fn from_upstream() -> bool {
    match abi::get_property(&["response", "code_details"]) {
        Ok(Some(details)) => details == b"via_upstream",
        _ => true,
    }
}

/// The error body Envoy has buffered for the current (held) response, at most MAX_ERROR_BODY.
fn buffered_error_body() -> Vec<u8> {
    let mut body = abi::buffer(BufferType::HttpResponseBody, 0, MAX_ERROR_BODY).unwrap_or_default();
    body.truncate(MAX_ERROR_BODY);
    body
}

/// A request that will never go upstream: drop what of its body arrived, so Envoy's buffer
/// limit (which would answer 413) is never reached by a large prompt.
fn drop_request_body(size: usize) {
    if size > 0 {
        let _ = abi::set_buffer(BufferType::HttpRequestBody, 0, size, &[]);
    }
}

/// Send a local answer. Failing that, the request goes on upstream (fail-open).
fn send_reply(reply: &LocalReply) -> Action {
    match abi::send_local_response(reply.status, &reply.headers, &reply.body) {
        Ok(()) => Action::Pause,
        Err(e) => {
            log::warn!(
                "llm_governor: could not send a local answer ({e}); letting the request through"
            );
            Action::Continue
        }
    }
}

fn apply(headers: &[(&'static str, String)]) {
    for (name, value) in headers {
        if let Err(e) = abi::replace_header(MapType::HttpResponseHeaders, name, value) {
            log::debug!("llm_governor: could not set response header {name}: {e}");
        }
    }
    record_for_access_log(headers);
}

/// Expose class, source, delay, held time and steered pool to Envoy's access log as filter
/// state (`%FILTER_STATE(wasm.llm_governor.class:PLAIN)%`, `.source`, `.delay_ms`,
/// `.held_ms`, `.pool`).
fn record_for_access_log(headers: &[(&'static str, String)]) {
    for (name, key) in [
        ("x-llm-governor-class", "llm_governor.class"),
        ("x-llm-governor-source", "llm_governor.source"),
        ("retry-after-ms", "llm_governor.delay_ms"),
        (HELD_MS_HEADER, "llm_governor.held_ms"),
        (POOL_HEADER, "llm_governor.pool"),
    ] {
        if let Some((_, v)) = headers.iter().find(|(n, _)| *n == name) {
            if let Err(e) = abi::set_property(&[key], v.as_bytes()) {
                log::debug!("llm_governor: could not set filter state {key}: {e}");
            }
        }
    }
}

struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = match abi::buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(b) => b,
            Err(e) => {
                log::error!("llm_governor: could not read the plugin configuration: {e}");
                return false;
            }
        };
        let cfg = match config::parse(&bytes) {
            Ok(cfg) => cfg,
            Err(e) => {
                log::error!("llm_governor: invalid configuration: {e}");
                return false;
            }
        };
        let metrics = HostMetrics::define(&cfg);
        self.shared = Some(Rc::new(Shared {
            governor: Governor::new(cfg),
            metrics: RefCell::new(metrics),
            rng: RefCell::new(HostRandom::seeded()),
            waits: RefCell::new(HashMap::new()),
            holds: RefCell::new(Holds::new()),
            held: RefCell::new(HashMap::new()),
            released: RefCell::new(HashMap::new()),
            headers_only_until: Cell::new(0),
            warned_body_unavailable: Cell::new(false),
            ticking: Cell::new(false),
        }));
        true
    }

    fn on_tick(&mut self) {
        if let Some(shared) = &self.shared {
            let now = abi::now_ms();
            shared.release_overdue(now);
            shared.release_held(now);
            shared.tick_as_needed();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Filter {
            shared,
            context_id,
            flow: None,
            held: false,
            reading_body: false,
            usage: None,
            finished: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter {
    shared: Rc<Shared>,
    context_id: u32,
    /// Set when the request went upstream; None for locally answered (and still held) requests.
    flow: Option<Flow>,
    /// The request was held (it may have been let go since: then its flow is in `released`).
    held: bool,
    /// Its body is being read before admission (`Wait::RequestBody`).
    reading_body: bool,
    /// Reads the usage of a successful response whose flow has token budgets to charge.
    usage: Option<UsageScanner>,
    finished: bool,
}

impl Filter {
    /// The flow of a request that went upstream, picking up one the tick let go.
    fn flow(&mut self) -> Option<&mut Flow> {
        if self.flow.is_none() {
            self.flow = self
                .shared
                .released
                .try_borrow_mut()
                .ok()
                .and_then(|mut m| m.remove(&self.context_id));
        }
        self.flow.as_mut()
    }

    /// Still held (not yet let go or answered)?
    fn still_held(&self) -> bool {
        // `held` first: a request that was never held pays no map lookup per body chunk.
        self.held && self.shared.is_held(self.context_id)
    }

    /// Classify the held response from the body buffered so far and let it go.
    fn release_response(&mut self) -> Action {
        if let Some(Wait::ResponseBody {
            mut flow,
            status,
            headers,
            ..
        }) = self.shared.take_wait(self.context_id)
        {
            let body = buffered_error_body();
            self.shared
                .classify_held(&mut flow, status, &headers, &body);
            self.flow = Some(flow);
        }
        Action::Continue
    }

    /// Do what admission decided for this request: let it go, hold it, or answer it (once
    /// its body has ended, so an HTTP/1.1 connection survives the answer). `buffered` is how
    /// much of its body Envoy holds for it now.
    fn take_step(
        &mut self,
        step: Option<Step>,
        body_done: bool,
        buffered: usize,
        now: &dyn Fn() -> u64,
    ) -> Action {
        let shared = self.shared.clone();
        let id = self.context_id;
        match step {
            Some(Step::Go(flow)) => {
                steer(&shared.governor, &flow);
                self.flow = Some(flow);
                Action::Continue
            }
            Some(Step::Held) => {
                self.held = true;
                shared.mark_held(id, body_done);
                shared.tick_as_needed();
                Action::Pause
            }
            Some(Step::Reply(_, reply)) => {
                record_for_access_log(&reply.headers);
                if body_done || !shared.body_callbacks_expected(now) {
                    return send_reply(&reply);
                }
                drop_request_body(buffered);
                shared.wait(
                    id,
                    Wait::RequestBodyEnd {
                        reply,
                        until_ms: now() + REQUEST_BODY_WAIT_MS,
                    },
                );
                Action::Pause
            }
            None => Action::Continue,
        }
    }

    /// The request body is complete: send the waiting local answer.
    fn send_waiting_reply(&mut self) -> Action {
        match self.shared.take_wait(self.context_id) {
            Some(Wait::RequestBodyEnd { reply, .. }) => send_reply(&reply),
            _ => Action::Continue,
        }
    }

    /// The stream is over (complete, reset or cancelled), or its context is going away: forget
    /// it if held, give back what it took, charge what the provider reported. Once.
    fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let shared = self.shared.clone();
        let id = self.context_id;
        // Most streams owe nothing at their end: read the clock only for those that do.
        let now = clock_on_demand();
        if let Some(Wait::ResponseBody { flow, .. }) = shared.take_wait(id) {
            self.flow = Some(flow);
        }
        if self.still_held() {
            if let Ok(mut holds) = shared.holds.try_borrow_mut() {
                shared.with_clock(Clock::lazy(&now), |_, env| holds.forget(id, env));
            }
            shared.unhold(id);
        }
        let usage = self.usage.take().and_then(|s| s.total());
        if let Some(flow) = self.flow().filter(|f| f.owes_at_end() || usage.is_some()) {
            shared.with_clock(Clock::lazy(&now), |g, env| {
                g.on_stream_end(flow, usage, env)
            });
        }
        shared.tick_as_needed();
    }
}

impl Context for Filter {}

impl Drop for Filter {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The host's clock, read on the first call and the same for every later one: one callback's
/// policy calls share one reading, and a callback that needs no time makes no hostcall.
fn clock_on_demand() -> impl Fn() -> u64 {
    let once = std::cell::OnceCell::new();
    move || *once.get_or_init(abi::now_ms)
}

fn header<'a>(map: &'a WireHeaders, name: &str) -> &'a [u8] {
    Headers::wire(map).get(name).unwrap_or(b"")
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let mut pairs = abi::header_map(MapType::HttpRequestHeaders).unwrap_or_default();
        if Headers::wire(&pairs).contains(POOL_HEADER) {
            // Only the policy picks a pool (and with it the route and the credential Envoy
            // injects): a client-sent one is dropped before anything matches on it, or the
            // request is refused if it cannot be.
            if let Err(e) = abi::remove_header(MapType::HttpRequestHeaders, POOL_HEADER) {
                log::warn!("llm_governor: could not remove a client-sent {POOL_HEADER} ({e}); refusing the request");
                let _ = abi::send_local_response(400, &[], b"x-llm-governor-pool is reserved\n");
                return Action::Pause;
            }
            pairs = abi::header_map(MapType::HttpRequestHeaders).unwrap_or_default();
        }
        let view = RequestView {
            path: header(&pairs, ":path"),
            authority: header(&pairs, ":authority"),
            headers: Headers::wire(&pairs),
        };
        // A request nothing is cooling or limiting by time is decided without the clock.
        let now = clock_on_demand();
        let shared = self.shared.clone();
        let id = self.context_id;
        let g = &shared.governor;
        if g.reads_body() && !end_of_stream && shared.body_callbacks_expected(&now) {
            // A limit reserves tokens (or keys by model): admission waits for the body.
            let read = BodyRead {
                flow: g.flow_for(&view),
                budget_ms: deadline::hold_budget_ms(&g.cfg.hold, &view.headers),
                content_length: view
                    .headers
                    .get_str("content-length")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
                until_ms: now() + BODY_WAIT_MS,
                seen: false,
            };
            shared.wait(id, Wait::RequestBody(read));
            self.reading_body = true;
            return Action::Pause;
        }
        let step = shared.with_clock(Clock::lazy(&now), |g, env| {
            let flow = g.flow_for(&view);
            let budget = deadline::hold_budget_ms(&g.cfg.hold, &view.headers);
            match shared.holds.try_borrow_mut() {
                Ok(mut holds) => holds.request(g, flow, budget, id, env),
                Err(_) => Step::Go(flow),
            }
        });
        self.take_step(step, end_of_stream, 0, &now)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.reading_body {
            let waiting = self.shared.is_reading_body(self.context_id, abi::now_ms());
            if waiting && !end_of_stream && body_size < estimate::MAX_BODY {
                return Action::Pause; // Envoy buffers what arrived
            }
            self.reading_body = false;
            match self.shared.take_body_read(self.context_id) {
                Some(read) => {
                    let now = abi::now_ms();
                    let step = self
                        .shared
                        .admit_read(self.context_id, read, Some(body_size), now);
                    return self.take_step(step, end_of_stream, body_size, &|| now);
                }
                // The tick admitted it on what had arrived (the body was slow): it may be held.
                None => self.held = true,
            }
        }
        if self.still_held() {
            // Envoy buffers the body until the request is let go; continuing here would
            // release the held headers too.
            if end_of_stream {
                self.shared.held_body_ended(self.context_id);
            }
            return Action::Pause;
        }
        if !self.shared.is_waiting_for_request_body(self.context_id) {
            return Action::Continue;
        }
        if end_of_stream {
            return self.send_waiting_reply();
        }
        drop_request_body(body_size);
        Action::Pause
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if std::mem::take(&mut self.reading_body) {
            match self.shared.take_body_read(self.context_id) {
                Some(read) => {
                    let now = abi::now_ms();
                    let step = self.shared.admit_read(self.context_id, read, None, now);
                    return self.take_step(step, true, estimate::MAX_BODY, &|| now);
                }
                None => self.held = true,
            }
        }
        if self.still_held() {
            self.shared.held_body_ended(self.context_id);
            return Action::Pause;
        }
        if self.shared.is_waiting_for_request_body(self.context_id) {
            return self.send_waiting_reply();
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let shared = self.shared.clone();
        let id = self.context_id;
        let Some(flow) = self.flow() else {
            return Action::Continue;
        };
        // What the client and the access log learn about a steered or held request.
        let steered = shared
            .governor
            .steered_to(flow)
            .map(|n| (POOL_HEADER, n.to_string()));
        let held = flow.held_ms.map(|ms| (HELD_MS_HEADER, ms.to_string()));
        let told: Vec<(&'static str, String)> = steered.into_iter().chain(held).collect();
        if !told.is_empty() {
            apply(&told);
        }
        let pairs = abi::header_map(MapType::HttpResponseHeaders).unwrap_or_default();
        let status = std::str::from_utf8(header(&pairs, ":status"))
            .ok()
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        let scan_usage = !flow.charges.is_empty() && (200..300).contains(&status) && !end_of_stream;
        // A plain success needs no time (nothing cools, nothing waits): the clock is read only
        // when the policy asks, once.
        let now = clock_on_demand();
        let governed = classify::is_governed_status(status);
        // An error the provider sent used no tokens: its reservations are given back. Envoy's
        // own errors (a reset, a timeout) say nothing of what the provider did: kept.
        let refund = status >= 400 && flow.reserves();
        let upstream = !(governed || refund) || from_upstream();
        if governed && !upstream {
            // Envoy's own 503 (upstream reset, connect failure, no healthy host) is not the
            // provider saying "not now": leave it ungoverned.
            shared.with_clock(Clock::lazy(&now), |g, env| g.on_envoy_response(flow, env));
            return Action::Continue;
        }
        if refund && upstream {
            shared.with_clock(Clock::lazy(&now), |g, env| g.on_upstream_error(flow, env));
        }
        let body_available = shared.body_callbacks_expected(&now);
        let step = shared.with_clock(Clock::lazy(&now), |g, env| {
            g.on_response_headers(
                flow,
                status,
                &Headers::wire(&pairs),
                end_of_stream,
                body_available,
                env,
            )
        });
        if scan_usage {
            self.usage = Some(UsageScanner::new());
        }
        match step {
            Some(ResponseStep::Rewrite(g)) => {
                apply(&g.headers);
                Action::Continue
            }
            Some(ResponseStep::NeedBody) => {
                let Some(flow) = self.flow.take() else {
                    return Action::Continue;
                };
                shared.wait(
                    id,
                    Wait::ResponseBody {
                        flow,
                        status,
                        headers: pairs,
                        until_ms: now() + BODY_WAIT_MS,
                    },
                );
                Action::Pause
            }
            Some(ResponseStep::Pass) | None => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if let Some(scanner) = &mut self.usage {
            if let Ok(chunk) = abi::buffer(BufferType::HttpResponseBody, 0, body_size) {
                scanner.feed(&chunk);
            }
            return Action::Continue;
        }
        if !self.shared.is_waiting_for_response_body(self.context_id) {
            return Action::Continue;
        }
        if !end_of_stream && body_size < MAX_ERROR_BODY {
            return Action::Pause;
        }
        self.release_response()
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.shared.is_waiting_for_response_body(self.context_id) {
            return self.release_response();
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.finish();
    }
}
