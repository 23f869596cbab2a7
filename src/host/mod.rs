//! The thin host layer: the only code that names proxy_wasm. It reads what Envoy hands over,
//! asks the pure policy what to do, and applies the answer. Every hostcall error is a value;
//! nothing here unwraps.

mod abi;
mod adapters;

use crate::config;
use crate::headers::Headers;
use crate::metrics::Counter;
use crate::policy::{Env, Flow, Governed, Governor, RequestDecision, RequestView, ResponseStep};
use crate::reply::LocalReply;
use crate::usage::UsageScanner;
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
/// After a body never came, how long to stop holding responses (Envoy is evidently configured
/// without `allow_on_headers_stop_iteration`), before trying again.
const HEADERS_ONLY_FOR_MS: u64 = 60_000;
const TICK_MS: u32 = 50;

proxy_wasm::main! {{
    let _ = log::set_logger(&HostLogger);
    log::set_max_level(log::LevelFilter::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { shared: None }) });
}}

/// A stream the filter is holding, with the moment it stops waiting for a body.
struct Held {
    what: Hold,
    deadline_ms: u64,
}

enum Hold {
    /// An upstream error response waiting for its body to be classified.
    Response {
        flow: Flow,
        status: u16,
        headers: Vec<(String, Vec<u8>)>,
    },
    /// A local answer waiting for the end of the request body: answering before the body
    /// has been read makes Envoy close an HTTP/1.1 connection, and every local 429 would then
    /// cost the client a new connection (and TLS handshake).
    Reply(LocalReply),
}

/// What one VM (one worker thread) shares between its root and stream contexts.
struct Shared {
    governor: Governor,
    metrics: RefCell<HostMetrics>,
    rng: RefCell<HostRandom>,
    held: RefCell<HashMap<u32, Held>>,
    /// Until when to classify 429s from headers only (body callbacks evidently not coming).
    headers_only_until: Cell<u64>,
    warned_body_unavailable: Cell<bool>,
}

impl Shared {
    /// Run a policy call with the host's store, metrics and randomness at `now_ms` (read once
    /// per callback: every hostcall crosses the V8 boundary).
    fn with_env<T>(&self, now_ms: u64, f: impl FnOnce(&Governor, &mut Env) -> T) -> Option<T> {
        let mut metrics = self.metrics.try_borrow_mut().ok()?;
        let mut rng = self.rng.try_borrow_mut().ok()?;
        let mut env = Env {
            store: &HostStore,
            metrics: &mut *metrics,
            rng: &mut *rng,
            now_ms,
        };
        Some(f(&self.governor, &mut env))
    }

    fn hold(&self, context_id: u32, held: Held) {
        let Ok(mut map) = self.held.try_borrow_mut() else {
            return;
        };
        if map.is_empty() {
            let _ = abi::set_tick_period_ms(TICK_MS);
        }
        map.insert(context_id, held);
    }

    fn take_held(&self, context_id: u32) -> Option<Held> {
        self.held.try_borrow_mut().ok()?.remove(&context_id)
    }

    fn is_holding(&self, context_id: u32, reply: bool) -> bool {
        self.held.try_borrow().is_ok_and(|m| {
            m.get(&context_id)
                .is_some_and(|h| matches!(h.what, Hold::Reply(_)) == reply)
        })
    }

    /// Body callbacks are known to work on this worker (or it is time to try again).
    fn body_callbacks_expected(&self, now: u64) -> bool {
        now >= self.headers_only_until.get()
    }

    /// Classify a held response from `body` (empty when it never came) and set its headers.
    fn classify_held(&self, flow: &Flow, status: u16, headers: &[(String, Vec<u8>)], body: &[u8]) {
        let governed = self
            .with_env(abi::now_ms(), |g, env| {
                g.on_response_body(flow, status, &Headers::new(headers), body, env)
            })
            .flatten();
        if let Some(g) = governed {
            apply(&g);
        }
    }

    /// Held streams whose body never came: answer from status and headers, let them go.
    fn release_overdue(&self) {
        let now = abi::now_ms();
        let overdue: Vec<(u32, Held)> = match self.held.try_borrow_mut() {
            Ok(mut map) => {
                let ids: Vec<u32> = map
                    .iter()
                    .filter(|(_, h)| h.deadline_ms <= now)
                    .map(|(id, _)| *id)
                    .collect();
                let out = ids
                    .into_iter()
                    .filter_map(|id| map.remove(&id).map(|h| (id, h)))
                    .collect();
                if map.is_empty() {
                    let _ = abi::set_tick_period_ms(0);
                }
                out
            }
            Err(_) => return,
        };
        for (id, held) in overdue {
            if abi::set_effective_context(id).is_err() {
                continue; // the stream is gone
            }
            self.headers_only_until.set(now + HEADERS_ONLY_FOR_MS);
            if !self.warned_body_unavailable.replace(true) {
                log::warn!(
                    "llm_governor: a held body never arrived; answering from status and headers alone. \
                     Set allow_on_headers_stop_iteration: true in the wasm plugin config so quota errors \
                     can be told from rate limits"
                );
            }
            match held.what {
                Hold::Response {
                    flow,
                    status,
                    headers,
                } => {
                    self.with_env(now, |_, env| {
                        env.metrics.count(flow.pool, Counter::BodyUnavailable)
                    });
                    self.classify_held(&flow, status, &headers, &[]);
                    if let Err(e) = abi::resume_response() {
                        log::warn!("llm_governor: could not resume a held response: {e}");
                    }
                }
                Hold::Reply(reply) => {
                    send_reply(&reply);
                }
            }
        }
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

fn apply(g: &Governed) {
    for (name, value) in &g.headers {
        if let Err(e) = abi::replace_header(MapType::HttpResponseHeaders, name, value) {
            log::debug!("llm_governor: could not set response header {name}: {e}");
        }
    }
    record_for_access_log(&g.headers);
}

/// Expose class, source and delay to Envoy's access log as filter state
/// (`%FILTER_STATE(wasm.llm_governor.class:PLAIN)%`, `.source`, `.delay_ms`).
fn record_for_access_log(headers: &[(&'static str, String)]) {
    for (name, key) in [
        ("x-llm-governor-class", "llm_governor.class"),
        ("x-llm-governor-source", "llm_governor.source"),
        ("retry-after-ms", "llm_governor.delay_ms"),
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
            held: RefCell::new(HashMap::new()),
            headers_only_until: Cell::new(0),
            warned_body_unavailable: Cell::new(false),
        }));
        true
    }

    fn on_tick(&mut self) {
        if let Some(shared) = &self.shared {
            shared.release_overdue();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let shared = self.shared.clone()?;
        Some(Box::new(Filter {
            shared,
            context_id,
            flow: None,
            usage: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter {
    shared: Rc<Shared>,
    context_id: u32,
    /// Set when the request went upstream; None for locally answered requests.
    flow: Option<Flow>,
    /// Reads the usage of a successful response whose flow has token budgets to charge.
    usage: Option<UsageScanner>,
}

impl Filter {
    /// Classify the held response from the body buffered so far and let it go.
    fn release_response(&mut self) -> Action {
        if let Some(Held {
            what:
                Hold::Response {
                    flow,
                    status,
                    headers,
                },
            ..
        }) = self.shared.take_held(self.context_id)
        {
            let body =
                abi::buffer(BufferType::HttpResponseBody, 0, MAX_ERROR_BODY).unwrap_or_default();
            let body = &body[..body.len().min(MAX_ERROR_BODY)];
            self.shared.classify_held(&flow, status, &headers, body);
        }
        Action::Continue
    }

    /// The request body is complete: send the held local answer.
    fn send_held_reply(&mut self) -> Action {
        match self.shared.take_held(self.context_id) {
            Some(Held {
                what: Hold::Reply(reply),
                ..
            }) => send_reply(&reply),
            _ => Action::Continue,
        }
    }
}

impl Context for Filter {}

impl Drop for Filter {
    fn drop(&mut self) {
        let _ = self.shared.take_held(self.context_id);
    }
}

fn header<'a>(pairs: &'a [(String, Vec<u8>)], name: &str) -> &'a [u8] {
    Headers::new(pairs).get(name).unwrap_or(b"")
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let pairs = abi::header_map(MapType::HttpRequestHeaders).unwrap_or_default();
        let view = RequestView {
            path: header(&pairs, ":path"),
            authority: header(&pairs, ":authority"),
            headers: Headers::new(&pairs),
        };
        let now = abi::now_ms();
        match self.shared.with_env(now, |g, env| g.on_request(&view, env)) {
            Some(RequestDecision::Forward(flow)) => {
                self.flow = Some(flow);
                Action::Continue
            }
            Some(RequestDecision::Reply(_, reply)) => {
                record_for_access_log(&reply.headers);
                if end_of_stream || !self.shared.body_callbacks_expected(now) {
                    return send_reply(&reply);
                }
                self.shared.hold(
                    self.context_id,
                    Held {
                        what: Hold::Reply(reply),
                        deadline_ms: now + BODY_WAIT_MS,
                    },
                );
                Action::Pause
            }
            None => Action::Continue,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.shared.is_holding(self.context_id, true) {
            return Action::Continue;
        }
        if end_of_stream {
            return self.send_held_reply();
        }
        // The request will never go upstream: drop what arrived so Envoy's buffer limit
        // (which would answer 413) is never reached by a large prompt.
        let _ = abi::set_buffer(BufferType::HttpRequestBody, 0, body_size, &[]);
        Action::Pause
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.shared.is_holding(self.context_id, true) {
            return self.send_held_reply();
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(flow) = self.flow.clone() else {
            return Action::Continue;
        };
        let pairs = abi::header_map(MapType::HttpResponseHeaders).unwrap_or_default();
        let status = std::str::from_utf8(header(&pairs, ":status"))
            .ok()
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        if !flow.charges.is_empty() && (200..300).contains(&status) && !end_of_stream {
            self.usage = Some(UsageScanner::new());
        }
        let now = abi::now_ms();
        let body_available = self.shared.body_callbacks_expected(now);
        let step = self.shared.with_env(now, |g, env| {
            g.on_response_headers(
                &flow,
                status,
                &Headers::new(&pairs),
                end_of_stream,
                body_available,
                env,
            )
        });
        match step {
            Some(ResponseStep::Rewrite(g)) => {
                apply(&g);
                Action::Continue
            }
            Some(ResponseStep::NeedBody) => {
                self.shared.hold(
                    self.context_id,
                    Held {
                        what: Hold::Response {
                            flow,
                            status,
                            headers: pairs,
                        },
                        deadline_ms: now + BODY_WAIT_MS,
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
        if !self.shared.is_holding(self.context_id, false) {
            return Action::Continue;
        }
        if !end_of_stream && body_size < MAX_ERROR_BODY {
            return Action::Pause;
        }
        self.release_response()
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.shared.is_holding(self.context_id, false) {
            return self.release_response();
        }
        Action::Continue
    }

    /// The stream is over (complete, reset or cancelled): charge what the provider reported.
    fn on_log(&mut self) {
        let (Some(flow), Some(scanner)) = (&self.flow, self.usage.take()) else {
            return;
        };
        if let Some(tokens) = scanner.total() {
            self.shared
                .with_env(abi::now_ms(), |g, env| g.on_usage(flow, tokens, env));
        }
    }
}
