//! OpenAI's answers: `x-ratelimit-*` headers, chat completions (whole and streamed),
//! embeddings, and its error bodies. Azure OpenAI shares the headers and most errors.

use serde_json::{json, Value};

use super::ids::rand_alnum;
use super::{sse_data, stream_response, Ctx, CONTENT, CONTENT_PIECES, ORG};
use crate::decision::{Decision, Outcome, Reason};
use crate::http::Response;
use crate::scenario::Dimension;
use crate::timefmt::go_duration_ms;

/// The `x-ratelimit-*` headers, the same on OpenAI and Azure OpenAI.
pub fn ratelimit_headers(resp: &mut Response, d: &Decision) {
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
}

/// OpenAI's headers on every answer: the rate limits, then its ids and organization.
pub fn headers(resp: &mut Response, d: &Decision) {
    ratelimit_headers(resp, d);
    resp.header(
        "x-request-id",
        format!("req_{}", rand_alnum(32).to_lowercase()),
    );
    resp.header("openai-organization", ORG);
    resp.header("openai-version", "2020-10-01");
    resp.header("openai-processing-ms", (d.latency_ms + 1).to_string());
}

fn usage(d: &Decision) -> Value {
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

/// A chat completion (also the answer to completions and responses), whole or streamed.
pub fn success(ctx: &Ctx) -> Response {
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
            "usage": usage(d),
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
            "usage": usage(d)
        })));
    }
    events.push(b"data: [DONE]\n\n".to_vec());
    stream_response(events, d.stream_delay_ms)
}

/// An embeddings list, one vector per input.
pub fn embeddings(ctx: &Ctx) -> Value {
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

fn err(message: &str, typ: &str, code: Value) -> Value {
    json!({"error": {"message": message, "type": typ, "param": null, "code": code}})
}

/// OpenAI's error body for a rejected or failed request (Azure's fallback too).
pub fn error(ctx: &Ctx) -> Value {
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
            err(&msg, typ, json!("rate_limit_exceeded"))
        }
        Outcome::Quota => err(
            "You exceeded your current quota, please check your plan and billing details. For more information on this error, read the docs: https://platform.openai.com/docs/guides/error-codes/api-errors.",
            "insufficient_quota",
            json!("insufficient_quota"),
        ),
        Outcome::Overloaded | Outcome::Unavailable | Outcome::Error(503) => err(
            "The server is overloaded or not ready yet.",
            "server_error",
            Value::Null,
        ),
        Outcome::Error(status) => status_error(ctx, status),
        _ => status_error(ctx, d.status),
    }
}

fn status_error(ctx: &Ctx, status: u16) -> Value {
    let model = ctx.model();
    match status {
        400 => err(
            "Invalid request (simulated by llm-sim).",
            "invalid_request_error",
            Value::Null,
        ),
        401 => err(
            "Incorrect API key provided: sk-sim***. You can find your API key at https://platform.openai.com/account/api-keys.",
            "invalid_request_error",
            json!("invalid_api_key"),
        ),
        403 => err(
            "You are not allowed to sample from this model (simulated by llm-sim).",
            "invalid_request_error",
            json!("permission_denied"),
        ),
        404 => err(
            &format!("The model `{model}` does not exist or you do not have access to it."),
            "invalid_request_error",
            json!("model_not_found"),
        ),
        413 => err(
            "Request too large (simulated by llm-sim).",
            "invalid_request_error",
            json!("request_too_large"),
        ),
        429 => err(
            &format!("Rate limit reached for {model} in organization {ORG} on requests per min (RPM). Visit https://platform.openai.com/account/rate-limits to learn more."),
            "requests",
            json!("rate_limit_exceeded"),
        ),
        s if s >= 500 => err(
            "The server had an error while processing your request. Sorry about that!",
            "server_error",
            Value::Null,
        ),
        s => err(
            &format!("Simulated error (status {s})."),
            "invalid_request_error",
            Value::Null,
        ),
    }
}
