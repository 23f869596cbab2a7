//! Thread-per-connection HTTP/1.1 server: keep-alive, admin API and provider endpoints.

use std::io::{BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{json, Value};

use crate::decision::Decision;
use crate::http::{self, ParseError, Request, Response};
use crate::providers::{self, Ctx, Route};
use crate::scenario::Scenario;
use crate::sim::prompt_cache::Prompt;
use crate::sim::{ReqInfo, State};

/// An idle keep-alive connection is closed after this long (long, so that a pooled upstream
/// connection in Envoy is practically never closed under it).
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
const THREAD_STACK: usize = 256 * 1024;

pub type Shared = Arc<Mutex<State>>;

pub fn lock(state: &Shared) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// A provider request counted in flight; dropping it (once the answer is written, or the
/// connection failed) ends it.
pub struct InFlight {
    state: Shared,
    key: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        lock(&self.state).finish(&self.key);
    }
}

/// Accepts connections forever, one thread each.
pub fn serve(listener: TcpListener, state: Shared) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let st = state.clone();
                // If the thread cannot be spawned the closure, and so the stream, is dropped.
                let _ = thread::Builder::new()
                    .name("llm-sim-conn".into())
                    .stack_size(THREAD_STACK)
                    .spawn(move || handle_conn(stream, st));
            }
            // e.g. EMFILE: back off a little instead of spinning.
            Err(_) => thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn handle_conn(stream: TcpStream, state: Shared) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(IDLE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IDLE_TIMEOUT));
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::with_capacity(16 * 1024, read_half);
    let mut writer = stream;
    loop {
        let req = match http::read_request(&mut reader, &mut writer) {
            Ok(r) => r,
            Err(ParseError::Closed) | Err(ParseError::Io(_)) => return,
            Err(ParseError::Bad(msg)) => {
                return fail(&mut writer, 400, msg);
            }
            Err(ParseError::TooLarge(msg)) => {
                return fail(&mut writer, 413, msg);
            }
        };
        let keep_alive = req.keep_alive();
        let (resp, in_flight) = handle(&req, &state);
        let written =
            http::write_response_then(&mut writer, resp, keep_alive, req.http10, move || {
                drop(in_flight)
            });
        if written.is_err() {
            return;
        }
        if !keep_alive {
            let _ = writer.shutdown(Shutdown::Write);
            return;
        }
    }
}

fn fail(w: &mut TcpStream, status: u16, msg: &str) {
    let body = json!({"error": {"message": format!("llm-sim: {msg}"), "type": "invalid_request_error", "param": null, "code": null}});
    let _ = http::write_response(w, Response::json(status, &body), false, false);
    let _ = w.flush();
    let _ = w.shutdown(Shutdown::Write);
}

fn admin_error(status: u16, msg: &str) -> Response {
    Response::json(status, &json!({"error": msg}))
}

/// Answers one request; a provider request stays in flight until the `InFlight` is dropped.
pub fn handle(req: &Request, state: &Shared) -> (Response, Option<InFlight>) {
    if req.path == "/_sim" || req.path.starts_with("/_sim/") {
        return (admin(req, state), None);
    }
    let Some(route) = providers::route(&req.path) else {
        let resp = Response::json(
            404,
            &json!({"error": {"message": format!("llm-sim: no provider endpoint at {}", req.path),
                              "type": "invalid_request_error", "param": null, "code": "unknown_url"}}),
        );
        return (resp, None);
    };
    let key = providers::account_key(req);
    let forced_status = (req.method != "POST").then_some(405);
    let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
    let prompt = (route.dialect == crate::dialect::Dialect::Anthropic)
        .then(|| Prompt::of(&body))
        .flatten();
    let model = body.get("model").and_then(Value::as_str).unwrap_or("-");
    let decision = lock(state).decide(
        &ReqInfo {
            method: &req.method,
            path: &req.path,
            key: &key,
            dialect: route.dialect,
            est_input_tokens: providers::estimate_tokens(&req.body),
            max_output_tokens: providers::output_limit(&body),
            forced_status,
            model,
            prompt: prompt.as_ref(),
        },
        Instant::now(),
        SystemTime::now(),
    );
    let in_flight = decision.in_flight.then(|| InFlight {
        state: state.clone(),
        key,
    });
    (
        respond(req, &body, &route, &decision, forced_status),
        in_flight,
    )
}

fn respond(
    req: &Request,
    body: &Value,
    route: &Route,
    decision: &Decision,
    forced_status: Option<u16>,
) -> Response {
    if let Some(status) = forced_status {
        let mut r = Response::json(
            status,
            &json!({"error": {"message": format!("llm-sim: {} is not allowed on {}", req.method, req.path),
                              "type": "invalid_request_error", "param": null, "code": null}}),
        );
        r.header("allow", "POST");
        return r;
    }
    if decision.latency_ms > 0 {
        thread::sleep(Duration::from_millis(decision.latency_ms));
    }
    providers::respond(&Ctx {
        route,
        req,
        body,
        d: decision,
    })
}

fn admin(req: &Request, state: &Shared) -> Response {
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/_sim/health") => Response::json(200, &json!({"ok": true})),
        ("POST", "/_sim/scenario") => match Scenario::parse(&req.body) {
            Ok(s) => {
                let doc = serde_json::to_value(&s).unwrap_or(Value::Null);
                lock(state).set_scenario(s);
                Response::json(200, &json!({"ok": true, "scenario": doc}))
            }
            Err(e) => admin_error(400, &e),
        },
        ("GET", "/_sim/scenario") => {
            let doc = serde_json::to_value(lock(state).scenario()).unwrap_or(Value::Null);
            Response::json(200, &doc)
        }
        ("POST", "/_sim/reset") => {
            lock(state).reset();
            Response::json(200, &json!({"ok": true}))
        }
        ("GET", "/_sim/requests") => {
            let doc = lock(state).requests_json();
            Response::json(200, &doc)
        }
        (_, "/_sim/health" | "/_sim/scenario" | "/_sim/reset" | "/_sim/requests") => {
            let mut r = admin_error(405, "method not allowed");
            r.header(
                "allow",
                match req.path.as_str() {
                    "/_sim/scenario" => "GET, POST",
                    "/_sim/reset" => "POST",
                    _ => "GET",
                },
            );
            r
        }
        _ => admin_error(404, "unknown admin path"),
    }
}
