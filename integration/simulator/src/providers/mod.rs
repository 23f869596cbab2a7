//! Provider dialects: the exact response shapes (bodies, streams and headers) of OpenAI, Azure
//! OpenAI, Anthropic and Gemini, one file each, for a decided request. `request` reads what the
//! simulator needs from a request; `retry` says how each dialect carries its retry hint.

mod anthropic;
mod azure;
mod gemini;
mod ids;
mod openai;
mod request;
mod retry;

use serde_json::Value;

use crate::decision::{Decision, Outcome};
use crate::dialect::Dialect;
use crate::http::{Body, Request, Response};

pub use request::{account_key, estimate_tokens, output_limit, route, Endpoint, Route};
pub use retry::sent_hint_ms;

pub const CONTENT: &str = "Hello from llm-sim";
const CONTENT_PIECES: [&str; 4] = ["Hello", " from", " llm", "-sim"];
const ORG: &str = "org-sim";

fn secs_ceil(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

fn sse_data(v: &Value) -> Vec<u8> {
    format!("data: {v}\n\n").into_bytes()
}

fn sse_event(name: &str, v: &Value) -> Vec<u8> {
    format!("event: {name}\ndata: {v}\n\n").into_bytes()
}

/// The per-request context for building a response.
pub struct Ctx<'a> {
    pub route: &'a Route,
    pub req: &'a Request,
    pub body: &'a Value,
    pub d: &'a Decision,
}

impl Ctx<'_> {
    fn model(&self) -> String {
        if let Some(m) = self.body.get("model").and_then(Value::as_str) {
            return m.to_string();
        }
        if let Endpoint::Gemini { model, .. } = &self.route.endpoint {
            return model.clone();
        }
        if let Some(dep) = &self.route.deployment {
            return dep.clone();
        }
        match self.route.dialect {
            Dialect::Anthropic => "claude-sonnet-4-5".into(),
            Dialect::Gemini => "gemini-2.0-flash".into(),
            _ => "gpt-4o".into(),
        }
    }

    fn wants_stream(&self) -> bool {
        match &self.route.endpoint {
            Endpoint::Gemini { stream, .. } => *stream,
            Endpoint::Embeddings => false,
            _ => self.body.get("stream").and_then(Value::as_bool) == Some(true),
        }
    }

    fn created(&self) -> u64 {
        self.d.now_unix_ms / 1000
    }
}

/// Builds the full response for a decided provider request.
pub fn respond(ctx: &Ctx) -> Response {
    let d = ctx.d;
    let dialect = ctx.route.dialect;
    let mut resp = match d.outcome {
        Outcome::Ok => success(ctx),
        Outcome::GeminiMinute | Outcome::GeminiDay => Response::json(d.status, &gemini::quota(ctx)),
        _ => match dialect {
            Dialect::OpenAi => Response::json(d.status, &openai::error(ctx)),
            Dialect::Azure => Response::json(d.status, &azure::error(ctx)),
            Dialect::Anthropic => Response::json(d.status, &anthropic::error(ctx)),
            Dialect::Gemini => Response::json(d.status, &gemini::error(ctx)),
        },
    };
    resp.header(
        "date",
        httpdate::fmt_http_date(std::time::SystemTime::now()),
    );
    match dialect {
        Dialect::OpenAi => openai::headers(&mut resp, d),
        Dialect::Azure => azure::headers(&mut resp, d),
        Dialect::Anthropic => anthropic::headers(&mut resp, d),
        Dialect::Gemini => {}
    }
    retry::headers(&mut resp, dialect, d);
    resp
}

fn success(ctx: &Ctx) -> Response {
    match ctx.route.endpoint {
        Endpoint::Messages => anthropic::success(ctx),
        Endpoint::Gemini { .. } => gemini::success(ctx),
        Endpoint::Embeddings => Response::json(200, &openai::embeddings(ctx)),
        _ => openai::success(ctx),
    }
}

fn stream_response(events: Vec<Vec<u8>>, delay_ms: u64) -> Response {
    let mut r = Response::new(200);
    r.header("content-type", "text/event-stream; charset=utf-8");
    r.header("cache-control", "no-cache");
    r.body = Body::Stream { events, delay_ms };
    r
}
