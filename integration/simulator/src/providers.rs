//! Provider dialects: routing by path, account keys, and the exact response shapes (bodies,
//! streams and headers) of OpenAI, Azure OpenAI, Anthropic and Gemini.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, Value};

use crate::http::{Body, Request, Response};
use crate::scenario::{Dimension, RetryStyle};
use crate::sim::{Decision, Dialect, Outcome, Reason};
use crate::timefmt::{go_duration_ms, http_date_ceil_ms, next_month, rfc3339_ceil_ms};

pub const CONTENT: &str = "Hello from llm-sim";
const CONTENT_PIECES: [&str; 4] = ["Hello", " from", " llm", "-sim"];
const ORG: &str = "org-sim";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Embeddings,
    Responses,
    Messages,
    Gemini { model: String, stream: bool },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dialect: Dialect,
    pub endpoint: Endpoint,
    /// Azure deployment name, from the path.
    pub deployment: Option<String>,
}

fn openai_endpoint(op: &str) -> Option<Endpoint> {
    match op {
        "chat/completions" => Some(Endpoint::Chat),
        "completions" => Some(Endpoint::Completions),
        "embeddings" => Some(Endpoint::Embeddings),
        "responses" => Some(Endpoint::Responses),
        _ => None,
    }
}

/// Decides the dialect and endpoint from the path; `None` for paths no provider serves.
pub fn route(path: &str) -> Option<Route> {
    let simple = |dialect, endpoint| {
        Some(Route {
            dialect,
            endpoint,
            deployment: None,
        })
    };
    if path == "/v1/messages" {
        return simple(Dialect::Anthropic, Endpoint::Messages);
    }
    if let Some(op) = path.strip_prefix("/v1/") {
        if let Some(ep) = openai_endpoint(op) {
            return simple(Dialect::OpenAi, ep);
        }
    }
    if let Some(rest) = path.strip_prefix("/openai/deployments/") {
        let (name, op) = rest.split_once('/')?;
        if name.is_empty() {
            return None;
        }
        return Some(Route {
            dialect: Dialect::Azure,
            endpoint: openai_endpoint(op)?,
            deployment: Some(name.to_string()),
        });
    }
    if let Some(op) = path.strip_prefix("/openai/v1/") {
        return simple(Dialect::Azure, openai_endpoint(op)?);
    }
    for prefix in ["/v1beta/models/", "/v1/models/", "/v1alpha/models/"] {
        if let Some(rest) = path.strip_prefix(prefix) {
            let (model, method) = rest.rsplit_once(':')?;
            if model.is_empty() || model.contains('/') {
                return None;
            }
            let stream = match method {
                "generateContent" => false,
                "streamGenerateContent" => true,
                _ => return None,
            };
            return simple(
                Dialect::Gemini,
                Endpoint::Gemini {
                    model: model.to_string(),
                    stream,
                },
            );
        }
    }
    None
}

/// The account key: first present of `x-api-key`, `authorization` (without `Bearer `),
/// `api-key`, `x-goog-api-key`, else query parameter `key`, else `-`.
pub fn account_key(req: &Request) -> String {
    for name in ["x-api-key", "authorization", "api-key", "x-goog-api-key"] {
        if let Some(v) = req.header(name) {
            let v = v.trim();
            let v = match v.get(..7) {
                Some(p) if p.eq_ignore_ascii_case("bearer ") => v[7..].trim_start(),
                _ => v,
            };
            return v.to_string();
        }
    }
    req.query_param("key").unwrap_or_else(|| "-".to_string())
}

/// Rough input-token estimate of a request body (4 bytes per token, at least 1).
pub fn estimate_tokens(body: &[u8]) -> u64 {
    (body.len() as u64 / 4).max(1)
}

/// The request's output limit, from the first of `max_tokens`, `max_completion_tokens`,
/// `max_output_tokens` and Gemini's `generationConfig.maxOutputTokens` (or
/// `generation_config.max_output_tokens`) that is a whole number >= 0; anything else (negative,
/// a string, a fraction, beyond u64) is ignored, as if absent.
pub fn output_limit(body: &Value) -> Option<u64> {
    [
        "/max_tokens",
        "/max_completion_tokens",
        "/max_output_tokens",
        "/generationConfig/maxOutputTokens",
        "/generation_config/max_output_tokens",
    ]
    .iter()
    .find_map(|p| body.pointer(p).and_then(Value::as_u64))
}

fn rand_u64() -> u64 {
    static CTR: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(CTR.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

fn rand_alnum(n: usize) -> String {
    const CHARS: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut out = String::with_capacity(n);
    let mut x = rand_u64();
    for i in 0..n {
        if i % 10 == 0 && i > 0 {
            x = rand_u64();
        }
        out.push(CHARS[(x % 62) as usize] as char);
        x /= 62;
    }
    out
}

fn uuid() -> String {
    let a = rand_u64();
    let b = rand_u64();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        ((b >> 48) & 0x3fff) | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

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
        Outcome::GeminiMinute | Outcome::GeminiDay => Response::json(d.status, &gemini_quota(ctx)),
        _ => match dialect {
            Dialect::OpenAi => Response::json(d.status, &openai_error(ctx)),
            Dialect::Azure => Response::json(d.status, &azure_error(ctx)),
            Dialect::Anthropic => Response::json(d.status, &anthropic_error(ctx)),
            Dialect::Gemini => Response::json(d.status, &gemini_error(ctx)),
        },
    };
    resp.header(
        "date",
        httpdate::fmt_http_date(std::time::SystemTime::now()),
    );
    match dialect {
        Dialect::OpenAi => openai_headers(&mut resp, d, false),
        Dialect::Azure => openai_headers(&mut resp, d, true),
        Dialect::Anthropic => anthropic_headers(&mut resp, d),
        Dialect::Gemini => {}
    }
    retry_headers(&mut resp, dialect, d);
    resp
}

/// How an answer carries its retry hint in headers: the scenario's style or the dialect's default.
fn retry_style(dialect: Dialect, d: &Decision) -> RetryStyle {
    match d.outcome {
        // Never fits: nothing to wait for.
        _ if d.reason == Reason::TokensTooLarge => d.style.unwrap_or(RetryStyle::None),
        Outcome::RateLimited
            if dialect == Dialect::Azure
                || (dialect == Dialect::OpenAi && d.reason == Reason::TokensExhausted) =>
        {
            d.style.unwrap_or(RetryStyle::Both)
        }
        Outcome::RateLimited | Outcome::Overloaded | Outcome::Unavailable
            if dialect != Dialect::Gemini =>
        {
            d.style.unwrap_or(RetryStyle::Seconds)
        }
        // Gemini carries its hint in RetryInfo; headers only if the scenario asks.
        Outcome::RateLimited
        | Outcome::Overloaded
        | Outcome::Unavailable
        | Outcome::GeminiMinute
        | Outcome::GeminiDay => d.style.unwrap_or(RetryStyle::None),
        Outcome::Ok | Outcome::Quota | Outcome::Error(_) => RetryStyle::None,
    }
}

/// Gemini's quota shapes carry `RetryInfo` unless the scenario says `retry_after: none`.
fn has_retry_info(d: &Decision) -> bool {
    matches!(d.outcome, Outcome::GeminiMinute | Outcome::GeminiDay)
        && d.style != Some(RetryStyle::None)
}

/// The retry hint an answer carries, in ms, as a client reads it: from the first present of
/// `retry-after-ms`, `retry-after` (whole seconds, or an HTTP-date rounded up to the second,
/// taken relative to the answer's time), the exhausted dimension's reset header (OpenAI/Azure:
/// exact; Anthropic: RFC 3339 rounded up to the second) and Gemini's `RetryInfo.retryDelay`
/// (whole seconds). `None` when the answer carries no hint.
pub fn sent_hint_ms(dialect: Dialect, d: &Decision) -> Option<u64> {
    let whole_secs = secs_ceil(d.hint_ms).saturating_mul(1000);
    let until_second = |ms: u64| {
        d.now_unix_ms
            .saturating_add(ms)
            .div_ceil(1000)
            .saturating_mul(1000)
            .saturating_sub(d.now_unix_ms)
    };
    match retry_style(dialect, d) {
        RetryStyle::Ms | RetryStyle::Both => Some(d.hint_ms),
        RetryStyle::Seconds => Some(whole_secs),
        RetryStyle::Date => Some(until_second(d.hint_ms)),
        RetryStyle::None => match (exhausted_reset_ms(d), dialect) {
            (Some(reset), Dialect::OpenAi | Dialect::Azure) => Some(reset),
            (Some(reset), Dialect::Anthropic) => Some(until_second(reset)),
            _ if has_retry_info(d) => Some(whole_secs),
            _ => None,
        },
    }
}

/// The reset the headers carry for the exhausted dimension, in ms (a token 429 of the `tpm`
/// bucket reports the time until the bucket is full, not the hint).
fn exhausted_reset_ms(d: &Decision) -> Option<u64> {
    let l = &d.limits;
    Some(match d.exhausted? {
        Dimension::Requests => l.reset_requests_ms,
        Dimension::Tokens => l.reset_tokens_ms,
        Dimension::InputTokens => l.reset_input_tokens_ms,
        Dimension::OutputTokens => l.reset_output_tokens_ms,
    })
}

/// Adds the retry hint headers in the scenario's style.
fn retry_headers(resp: &mut Response, dialect: Dialect, d: &Decision) {
    let secs = secs_ceil(d.hint_ms).to_string();
    match retry_style(dialect, d) {
        RetryStyle::Seconds => resp.header("retry-after", secs),
        RetryStyle::Ms => resp.header("retry-after-ms", d.hint_ms.to_string()),
        RetryStyle::Date => resp.header(
            "retry-after",
            http_date_ceil_ms(d.now_unix_ms.saturating_add(d.hint_ms)),
        ),
        RetryStyle::Both => {
            resp.header("retry-after", secs);
            resp.header("retry-after-ms", d.hint_ms.to_string());
        }
        RetryStyle::None => {}
    }
}

fn openai_headers(resp: &mut Response, d: &Decision, azure: bool) {
    let l = &d.limits;
    // OpenAI has one token dimension: input/output exhaustion is reported on it.
    let (rem_tokens, reset_tokens) = match d.exhausted {
        Some(Dimension::InputTokens | Dimension::OutputTokens) => (0, d.hint_ms),
        _ => (l.remaining_tokens, l.reset_tokens_ms),
    };
    resp.header("x-ratelimit-limit-requests", l.limit_requests.to_string());
    resp.header("x-ratelimit-limit-tokens", l.limit_tokens.to_string());
    resp.header(
        "x-ratelimit-remaining-requests",
        l.remaining_requests.to_string(),
    );
    resp.header("x-ratelimit-remaining-tokens", rem_tokens.to_string());
    resp.header(
        "x-ratelimit-reset-requests",
        go_duration_ms(l.reset_requests_ms),
    );
    resp.header("x-ratelimit-reset-tokens", go_duration_ms(reset_tokens));
    if azure {
        resp.header("apim-request-id", uuid());
        resp.header("x-request-id", uuid());
        resp.header("x-ms-region", "Sweden Central");
    } else {
        resp.header(
            "x-request-id",
            format!("req_{}", rand_alnum(32).to_lowercase()),
        );
        resp.header("openai-organization", ORG);
        resp.header("openai-version", "2020-10-01");
        resp.header("openai-processing-ms", (d.latency_ms + 1).to_string());
    }
}

fn anthropic_headers(resp: &mut Response, d: &Decision) {
    let l = &d.limits;
    let at = |ms: u64| rfc3339_ceil_ms(d.now_unix_ms.saturating_add(ms));
    let dims = [
        (
            "requests",
            l.limit_requests,
            l.remaining_requests,
            l.reset_requests_ms,
        ),
        (
            "tokens",
            l.limit_tokens,
            l.remaining_tokens,
            l.reset_tokens_ms,
        ),
        (
            "input-tokens",
            l.limit_input_tokens,
            l.remaining_input_tokens,
            l.reset_input_tokens_ms,
        ),
        (
            "output-tokens",
            l.limit_output_tokens,
            l.remaining_output_tokens,
            l.reset_output_tokens_ms,
        ),
    ];
    for (name, limit, remaining, reset) in dims {
        resp.header(
            &format!("anthropic-ratelimit-{name}-limit"),
            limit.to_string(),
        );
        resp.header(
            &format!("anthropic-ratelimit-{name}-remaining"),
            remaining.to_string(),
        );
        resp.header(&format!("anthropic-ratelimit-{name}-reset"), at(reset));
    }
    resp.header("request-id", format!("req_011C{}", rand_alnum(20)));
    resp.header(
        "anthropic-organization-id",
        "00000000-0000-4000-8000-00000000051a",
    );
}

// ---------------------------------------------------------------------------------------------
// Success bodies and streams
// ---------------------------------------------------------------------------------------------

fn success(ctx: &Ctx) -> Response {
    match ctx.route.endpoint {
        Endpoint::Messages => anthropic_success(ctx),
        Endpoint::Gemini { .. } => gemini_success(ctx),
        Endpoint::Embeddings => Response::json(200, &openai_embeddings(ctx)),
        _ => openai_success(ctx),
    }
}

fn stream_response(events: Vec<Vec<u8>>, delay_ms: u64) -> Response {
    let mut r = Response::new(200);
    r.header("content-type", "text/event-stream; charset=utf-8");
    r.header("cache-control", "no-cache");
    r.body = Body::Stream { events, delay_ms };
    r
}

fn openai_usage(d: &Decision) -> Value {
    json!({
        "prompt_tokens": d.input_tokens,
        "completion_tokens": d.output_tokens,
        "total_tokens": d.input_tokens.saturating_add(d.output_tokens),
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0
        }
    })
}

fn openai_success(ctx: &Ctx) -> Response {
    let d = ctx.d;
    let id = format!("chatcmpl-{}", rand_alnum(29));
    let model = ctx.model();
    let created = ctx.created();
    if !ctx.wants_stream() {
        let body = json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": CONTENT, "refusal": null, "annotations": []},
                "logprobs": null,
                "finish_reason": "stop"
            }],
            "usage": openai_usage(d),
            "service_tier": "default",
            "system_fingerprint": "fp_llmsim"
        });
        return Response::json(200, &body);
    }
    let include_usage = ctx
        .body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        == Some(true);
    let chunk = |delta: Value, finish: Value| {
        let mut c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "service_tier": "default",
            "system_fingerprint": "fp_llmsim",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        sse_data(&c)
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": "", "refusal": null}),
        Value::Null,
    )];
    for piece in CONTENT_PIECES {
        events.push(chunk(json!({"content": piece}), Value::Null));
    }
    events.push(chunk(json!({}), json!("stop")));
    if include_usage {
        events.push(sse_data(&json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "service_tier": "default",
            "system_fingerprint": "fp_llmsim",
            "choices": [],
            "usage": openai_usage(d)
        })));
    }
    events.push(b"data: [DONE]\n\n".to_vec());
    stream_response(events, d.stream_delay_ms)
}

fn openai_embeddings(ctx: &Ctx) -> Value {
    let n = match ctx.body.get("input") {
        Some(Value::Array(a)) => a.len().max(1),
        _ => 1,
    };
    let data: Vec<Value> = (0..n)
        .map(|i| {
            json!({"object": "embedding", "index": i,
                   "embedding": [0.0023064255, -0.009327292, 0.015797347, -0.0077780345]})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": ctx.model(),
        "usage": {"prompt_tokens": ctx.d.input_tokens, "total_tokens": ctx.d.input_tokens}
    })
}

fn anthropic_success(ctx: &Ctx) -> Response {
    let d = ctx.d;
    let id = format!("msg_01{}", rand_alnum(22));
    let model = ctx.model();
    if !ctx.wants_stream() {
        let body = json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": CONTENT}],
            "stop_reason": "end_turn",
            "stop_sequence": null,
            "usage": {
                "input_tokens": d.input_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": d.output_tokens,
                "service_tier": "standard"
            }
        });
        return Response::json(200, &body);
    }
    let mut events = vec![
        sse_event(
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": d.input_tokens, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 0, "output_tokens": 1,
                          "service_tier": "standard"}
            }}),
        ),
        sse_event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}),
        ),
        sse_event("ping", &json!({"type": "ping"})),
    ];
    for piece in CONTENT_PIECES {
        events.push(sse_event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": piece}}),
        ));
    }
    events.push(sse_event(
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": 0}),
    ));
    events.push(sse_event(
        "message_delta",
        &json!({"type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                "usage": {"output_tokens": d.output_tokens}}),
    ));
    events.push(sse_event("message_stop", &json!({"type": "message_stop"})));
    stream_response(events, d.stream_delay_ms)
}

fn gemini_candidate(text: &str, finish: bool) -> Value {
    let mut c = json!({"content": {"parts": [{"text": text}], "role": "model"}, "index": 0});
    if finish {
        c["finishReason"] = json!("STOP");
    }
    c
}

fn gemini_success(ctx: &Ctx) -> Response {
    let d = ctx.d;
    let model = ctx.model();
    let response_id = rand_alnum(22);
    let usage = json!({
        "promptTokenCount": d.input_tokens,
        "candidatesTokenCount": d.output_tokens,
        "totalTokenCount": d.input_tokens.saturating_add(d.output_tokens),
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": d.input_tokens}]
    });
    let full = json!({
        "candidates": [gemini_candidate(CONTENT, true)],
        "usageMetadata": usage,
        "modelVersion": model,
        "responseId": response_id
    });
    if !ctx.wants_stream() {
        return Response::json(200, &full);
    }
    let sse = ctx.req.query_param("alt").as_deref() == Some("sse");
    if !sse {
        // Without alt=sse the streaming method answers one JSON array.
        return Response::json(200, &json!([full]));
    }
    let n = CONTENT_PIECES.len();
    let events = CONTENT_PIECES
        .iter()
        .enumerate()
        .map(|(i, piece)| {
            let last = i + 1 == n;
            let mut v = json!({
                "candidates": [gemini_candidate(piece, last)],
                "modelVersion": model,
                "responseId": response_id
            });
            if last {
                v["usageMetadata"] = usage.clone();
            }
            format!("data: {v}\r\n\r\n").into_bytes()
        })
        .collect();
    stream_response(events, d.stream_delay_ms)
}

// ---------------------------------------------------------------------------------------------
// Error bodies
// ---------------------------------------------------------------------------------------------

fn openai_err(message: &str, typ: &str, code: Value) -> Value {
    json!({"error": {"message": message, "type": typ, "param": null, "code": code}})
}

fn openai_error(ctx: &Ctx) -> Value {
    let d = ctx.d;
    let l = &d.limits;
    match d.outcome {
        Outcome::RateLimited => {
            let model = ctx.model();
            let wait = go_duration_ms(d.hint_ms);
            let (typ, msg) = if d.reason == Reason::Concurrency {
                (
                    "requests",
                    format!(
                        "Rate limit reached for {model} in organization {ORG} on concurrent requests. Please try again in {wait}. Visit https://platform.openai.com/account/rate-limits to learn more."
                    ),
                )
            } else if let (Some(t), Reason::TokensTooLarge) = (d.tokens, d.reason) {
                (
                    "tokens",
                    format!(
                        "Request too large for {model} in organization {ORG} on tokens per min (TPM): Limit {}, Requested {}. The input or output tokens must be reduced in order to run successfully. Visit https://platform.openai.com/account/rate-limits to learn more.",
                        t.limit, t.counted
                    ),
                )
            } else if let (Some(t), Reason::TokensExhausted) = (d.tokens, d.reason) {
                (
                    "tokens",
                    format!(
                        "Rate limit reached for {model} in organization {ORG} on tokens per min (TPM): Limit {}, Used {}, Requested {}. Please try again in {wait}. Visit https://platform.openai.com/account/rate-limits to learn more.",
                        t.limit, t.used, t.counted
                    ),
                )
            } else if d.exhausted.is_some_and(Dimension::is_tokens) {
                let requested = d.input_tokens.saturating_add(d.output_tokens);
                (
                    "tokens",
                    format!(
                        "Rate limit reached for {model} in organization {ORG} on tokens per min (TPM): Limit {}, Used {}, Requested {requested}. Please try again in {wait}. Visit https://platform.openai.com/account/rate-limits to learn more.",
                        l.limit_tokens,
                        l.limit_tokens.saturating_sub(requested / 2),
                    ),
                )
            } else {
                (
                    "requests",
                    format!(
                        "Rate limit reached for {model} in organization {ORG} on requests per min (RPM): Limit {0}, Used {0}, Requested 1. Please try again in {wait}. Visit https://platform.openai.com/account/rate-limits to learn more.",
                        l.limit_requests
                    ),
                )
            };
            openai_err(&msg, typ, json!("rate_limit_exceeded"))
        }
        Outcome::Quota => openai_err(
            "You exceeded your current quota, please check your plan and billing details. For more information on this error, read the docs: https://platform.openai.com/docs/guides/error-codes/api-errors.",
            "insufficient_quota",
            json!("insufficient_quota"),
        ),
        Outcome::Overloaded | Outcome::Unavailable | Outcome::Error(503) => openai_err(
            "The server is overloaded or not ready yet.",
            "server_error",
            Value::Null,
        ),
        Outcome::Error(status) => openai_status_error(ctx, status),
        _ => openai_status_error(ctx, d.status),
    }
}

fn openai_status_error(ctx: &Ctx, status: u16) -> Value {
    let model = ctx.model();
    match status {
        400 => openai_err(
            "Invalid request (simulated by llm-sim).",
            "invalid_request_error",
            Value::Null,
        ),
        401 => openai_err(
            "Incorrect API key provided: sk-sim***. You can find your API key at https://platform.openai.com/account/api-keys.",
            "invalid_request_error",
            json!("invalid_api_key"),
        ),
        403 => openai_err(
            "You are not allowed to sample from this model (simulated by llm-sim).",
            "invalid_request_error",
            json!("permission_denied"),
        ),
        404 => openai_err(
            &format!("The model `{model}` does not exist or you do not have access to it."),
            "invalid_request_error",
            json!("model_not_found"),
        ),
        413 => openai_err(
            "Request too large (simulated by llm-sim).",
            "invalid_request_error",
            json!("request_too_large"),
        ),
        429 => openai_err(
            &format!("Rate limit reached for {model} in organization {ORG} on requests per min (RPM). Visit https://platform.openai.com/account/rate-limits to learn more."),
            "requests",
            json!("rate_limit_exceeded"),
        ),
        s if s >= 500 => openai_err(
            "The server had an error while processing your request. Sorry about that!",
            "server_error",
            Value::Null,
        ),
        s => openai_err(
            &format!("Simulated error (status {s})."),
            "invalid_request_error",
            Value::Null,
        ),
    }
}

fn azure_error(ctx: &Ctx) -> Value {
    let d = ctx.d;
    match d.outcome {
        Outcome::RateLimited => {
            let op = match ctx.route.endpoint {
                Endpoint::Completions => "Completions_Create",
                Endpoint::Embeddings => "Embeddings_Create",
                Endpoint::Responses => "Responses_Create",
                _ => "ChatCompletions_Create",
            };
            let version = ctx
                .req
                .query_param("api-version")
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "2024-10-21".to_string());
            let kind = if d.reason == Reason::Concurrency {
                "concurrent request limit"
            } else if d.exhausted.is_some_and(Dimension::is_tokens) {
                "token rate limit"
            } else {
                "call rate limit"
            };
            let secs = secs_ceil(d.hint_ms);
            let unit = if secs == 1 { "second" } else { "seconds" };
            json!({"error": {"code": "429", "message": format!(
                "Requests to the {op} Operation under Azure OpenAI API version {version} have exceeded {kind} of your current OpenAI S0 pricing tier. Please retry after {secs} {unit}. Please go here: https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."
            )}})
        }
        Outcome::Error(401) => json!({"error": {"code": "401", "message":
            "Access denied due to invalid subscription key or wrong API endpoint. Make sure to provide a valid key for an active subscription and use a correct regional API endpoint for your resource."}}),
        Outcome::Error(404) => json!({"error": {"code": "DeploymentNotFound", "message":
            "The API deployment for this resource does not exist. If you created the deployment within the last 5 minutes, please wait a moment and try again."}}),
        Outcome::Error(400) => json!({"error": {"code": "BadRequest", "message":
            "Invalid request (simulated by llm-sim).", "param": null, "type": null}}),
        _ => openai_error(ctx),
    }
}

fn anthropic_err(typ: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": typ, "message": message}})
}

fn anthropic_error(ctx: &Ctx) -> Value {
    let d = ctx.d;
    let l = &d.limits;
    match d.outcome {
        Outcome::RateLimited => {
            let what = match d.exhausted.unwrap_or_default() {
                _ if d.reason == Reason::Concurrency => "on concurrent requests".to_string(),
                Dimension::Requests => format!("of {} requests per minute", l.limit_requests),
                Dimension::Tokens => format!("of {} tokens per minute", l.limit_tokens),
                Dimension::InputTokens => {
                    format!("of {} input tokens per minute", l.limit_input_tokens)
                }
                Dimension::OutputTokens => {
                    format!("of {} output tokens per minute", l.limit_output_tokens)
                }
            };
            anthropic_err(
                "rate_limit_error",
                &format!("This request would exceed the rate limit for your organization ({ORG}) {what}. For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for current usage. Please reduce the prompt length or the maximum tokens requested, or try again later. You may also contact sales at https://www.anthropic.com/contact-sales to discuss your options for a rate limit increase."),
            )
        }
        Outcome::Quota => {
            let (y, m) = next_month(d.now_unix_ms / 1000);
            let mut v = anthropic_err(
                "rate_limit_error",
                &format!("You have reached your specified workspace API usage limits. You will regain access on {y:04}-{m:02}-01 at 00:00 UTC."),
            );
            v["error_code"] = json!("enforced_spend_limit_reached");
            v
        }
        Outcome::Overloaded => anthropic_err("overloaded_error", "Overloaded"),
        Outcome::Unavailable => anthropic_err("api_error", "Service Unavailable"),
        Outcome::Error(s) => {
            let (typ, msg) = match s {
                400 => (
                    "invalid_request_error",
                    "Invalid request (simulated by llm-sim).",
                ),
                401 => ("authentication_error", "invalid x-api-key"),
                403 => (
                    "permission_error",
                    "Your API key does not have permission to use the specified resource.",
                ),
                404 => (
                    "not_found_error",
                    "The requested resource could not be found.",
                ),
                413 => (
                    "request_too_large",
                    "Request exceeds the maximum allowed number of bytes.",
                ),
                429 => (
                    "rate_limit_error",
                    "Number of request tokens has exceeded your per-minute rate limit.",
                ),
                529 => ("overloaded_error", "Overloaded"),
                _ if s >= 500 => ("api_error", "Internal server error"),
                _ => ("invalid_request_error", "Simulated error (llm-sim)."),
            };
            anthropic_err(typ, msg)
        }
        _ => anthropic_err("api_error", "Internal server error"),
    }
}

fn gemini_status_name(status: u16) -> &'static str {
    match status {
        400 | 413 => "INVALID_ARGUMENT",
        401 => "UNAUTHENTICATED",
        403 => "PERMISSION_DENIED",
        404 => "NOT_FOUND",
        409 => "ABORTED",
        429 => "RESOURCE_EXHAUSTED",
        500 => "INTERNAL",
        503 => "UNAVAILABLE",
        504 => "DEADLINE_EXCEEDED",
        _ => "UNKNOWN",
    }
}

fn gemini_error(ctx: &Ctx) -> Value {
    let status = ctx.d.status;
    let message = match ctx.d.outcome {
        Outcome::Overloaded | Outcome::Unavailable => {
            "The model is overloaded. Please try again later."
        }
        Outcome::Quota | Outcome::RateLimited => "You exceeded your current quota.",
        _ => match status {
            400 => "Invalid request (simulated by llm-sim).",
            401 | 403 => "API key not valid. Please pass a valid API key.",
            404 => "models/unknown is not found for API version v1beta, or is not supported for generateContent.",
            413 => "Request payload size exceeds the limit.",
            _ => "An internal error has occurred. Please retry or report in https://developers.generativeai.google/guide/troubleshooting",
        },
    };
    json!({"error": {"code": status, "message": message, "status": gemini_status_name(status)}})
}

fn gemini_quota(ctx: &Ctx) -> Value {
    let d = ctx.d;
    let day = d.outcome == Outcome::GeminiDay;
    let model = match &ctx.route.endpoint {
        Endpoint::Gemini { model, .. } => model.clone(),
        _ => "gemini-2.0-flash".to_string(),
    };
    let (quota_id, value) = if day {
        ("GenerateRequestsPerDayPerProjectPerModel-FreeTier", 1500)
    } else {
        (
            "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
            if d.limits.limit_requests == 60 {
                15
            } else {
                d.limits.limit_requests
            },
        )
    };
    let mut details = vec![
        json!({
            "@type": "type.googleapis.com/google.rpc.QuotaFailure",
            "violations": [{
                "quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                "quotaId": quota_id,
                "quotaDimensions": {"location": "global", "model": model},
                "quotaValue": value.to_string()
            }]
        }),
        json!({
            "@type": "type.googleapis.com/google.rpc.Help",
            "links": [{"description": "Learn more about Gemini API quotas",
                       "url": "https://ai.google.dev/gemini-api/docs/rate-limits"}]
        }),
    ];
    if has_retry_info(d) {
        details.push(json!({
            "@type": "type.googleapis.com/google.rpc.RetryInfo",
            "retryDelay": format!("{}s", secs_ceil(d.hint_ms))
        }));
    }
    json!({"error": {
        "code": 429,
        "message": "You exceeded your current quota, please check your plan and billing details. For more information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.",
        "status": "RESOURCE_EXHAUSTED",
        "details": details
    }})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            route("/v1/chat/completions").unwrap().dialect,
            Dialect::OpenAi
        );
        assert_eq!(
            route("/v1/embeddings").unwrap().endpoint,
            Endpoint::Embeddings
        );
        assert_eq!(route("/v1/messages").unwrap().dialect, Dialect::Anthropic);
        let az = route("/openai/deployments/gpt4o-prod/chat/completions").unwrap();
        assert_eq!(az.dialect, Dialect::Azure);
        assert_eq!(az.deployment.as_deref(), Some("gpt4o-prod"));
        let g = route("/v1beta/models/gemini-2.0-flash:generateContent").unwrap();
        assert_eq!(
            g.endpoint,
            Endpoint::Gemini {
                model: "gemini-2.0-flash".into(),
                stream: false
            }
        );
        assert!(route("/v1beta/models/x:countTokens").is_none());
        assert!(route("/openai/deployments//chat/completions").is_none());
        assert!(route("/v1/models").is_none());
        assert!(route("/").is_none());
    }

    #[test]
    fn account_keys() {
        let mk = |headers: &[(&str, &str)], query: &str| Request {
            method: "POST".into(),
            path: "/".into(),
            query: query.into(),
            http10: false,
            headers: headers
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            body: vec![],
        };
        assert_eq!(
            account_key(&mk(&[("authorization", "Bearer sk-a")], "")),
            "sk-a"
        );
        assert_eq!(
            account_key(&mk(
                &[("authorization", "Bearer sk-a"), ("x-api-key", "ak")],
                ""
            )),
            "ak"
        );
        assert_eq!(account_key(&mk(&[("api-key", "az")], "")), "az");
        assert_eq!(account_key(&mk(&[("x-goog-api-key", "g")], "key=q")), "g");
        assert_eq!(account_key(&mk(&[], "alt=sse&key=q")), "q");
        assert_eq!(account_key(&mk(&[], "")), "-");
        assert_eq!(account_key(&mk(&[("authorization", "Bear")], "")), "Bear");
    }

    #[test]
    fn output_limits() {
        let rows: [(&str, Option<u64>); 13] = [
            (r#"{"max_tokens":200}"#, Some(200)),
            (r#"{"max_completion_tokens":300}"#, Some(300)),
            (r#"{"max_output_tokens":400}"#, Some(400)),
            (r#"{"generationConfig":{"maxOutputTokens":500}}"#, Some(500)),
            (
                r#"{"generation_config":{"max_output_tokens":600}}"#,
                Some(600),
            ),
            (r#"{"max_tokens":0}"#, Some(0)),
            (r#"{"max_tokens":18446744073709551615}"#, Some(u64::MAX)),
            // Not a whole number >= 0: ignored, the next one (if any) counts.
            (r#"{"max_tokens":-1,"max_completion_tokens":50}"#, Some(50)),
            (r#"{"max_tokens":"200"}"#, None),
            (r#"{"max_tokens":200.5}"#, None),
            (r#"{"max_tokens":1e300}"#, None),
            (r#"{"max_tokens":18446744073709551616}"#, None),
            (r#"{"generationConfig":{"maxOutputTokens":null}}"#, None),
        ];
        for (body, want) in rows {
            let v: Value = serde_json::from_str(body).unwrap();
            assert_eq!(output_limit(&v), want, "{body}");
        }
        assert_eq!(output_limit(&Value::Null), None);
        assert_eq!(output_limit(&json!([1, 2])), None);
    }

    #[test]
    fn ids() {
        assert_eq!(rand_alnum(29).len(), 29);
        assert_ne!(rand_alnum(16), rand_alnum(16));
        assert_eq!(uuid().len(), 36);
    }
}
