//! Anthropic's answers: `anthropic-ratelimit-*` headers, messages (whole and streamed), and its
//! error bodies.

use serde_json::{json, Value};

use super::ids::rand_alnum;
use super::{sse_event, stream_response, Ctx, CONTENT, CONTENT_PIECES, ORG};
use crate::decision::{Decision, Outcome, Reason};
use crate::http::Response;
use crate::scenario::Dimension;
use crate::timefmt::{next_month, rfc3339_ceil_ms};

/// Anthropic's headers on every answer: each dimension's limit, remaining and reset, then ids.
pub fn headers(resp: &mut Response, d: &Decision) {
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

/// A message, whole or streamed as Anthropic's named events.
pub fn success(ctx: &Ctx) -> Response {
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
                "cache_creation_input_tokens": d.cache_creation_tokens,
                "cache_read_input_tokens": d.cache_read_tokens,
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
                "usage": {"input_tokens": d.input_tokens, "cache_creation_input_tokens": d.cache_creation_tokens,
                          "cache_read_input_tokens": d.cache_read_tokens, "output_tokens": 1,
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

fn err(typ: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": typ, "message": message}})
}

/// Anthropic's error body for a rejected or failed request.
pub fn error(ctx: &Ctx) -> Value {
    let d = ctx.d;
    let l = &d.limits;
    match d.outcome {
        Outcome::RateLimited => {
            let what = match d.exhausted.unwrap_or_default() {
                _ if d.reason == Reason::Concurrency => "on concurrent requests".to_string(),
                Dimension::Requests if d.reason == Reason::DayExhausted => {
                    "of requests per day".to_string()
                }
                Dimension::Requests => format!("of {} requests per minute", l.limit_requests),
                Dimension::Tokens => format!("of {} tokens per minute", l.limit_tokens),
                Dimension::InputTokens => {
                    format!("of {} input tokens per minute", l.limit_input_tokens)
                }
                Dimension::OutputTokens => {
                    format!("of {} output tokens per minute", l.limit_output_tokens)
                }
            };
            err(
                "rate_limit_error",
                &format!("This request would exceed the rate limit for your organization ({ORG}) {what}. For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for current usage. Please reduce the prompt length or the maximum tokens requested, or try again later. You may also contact sales at https://www.anthropic.com/contact-sales to discuss your options for a rate limit increase."),
            )
        }
        Outcome::Quota => {
            let (y, m) = next_month(d.now_unix_ms / 1000);
            let mut v = err(
                "rate_limit_error",
                &format!("You have reached your specified workspace API usage limits. You will regain access on {y:04}-{m:02}-01 at 00:00 UTC."),
            );
            v["error_code"] = json!("enforced_spend_limit_reached");
            v
        }
        Outcome::Overloaded => err("overloaded_error", "Overloaded"),
        Outcome::Unavailable => err("api_error", "Service Unavailable"),
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
            err(typ, msg)
        }
        _ => err("api_error", "Internal server error"),
    }
}
