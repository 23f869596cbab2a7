//! Gemini's answers: generateContent (whole, streamed as SSE or as one JSON array), its error
//! bodies, and the per-minute and per-day quota errors with `RetryInfo`.

use serde_json::{json, Value};

use super::ids::rand_alnum;
use super::request::Endpoint;
use super::retry::has_retry_info;
use super::{secs_ceil, stream_response, Ctx, CONTENT, CONTENT_PIECES};
use crate::decision::Outcome;
use crate::http::Response;

fn candidate(text: &str, finish: bool) -> Value {
    let mut c = json!({"content": {"parts": [{"text": text}], "role": "model"}, "index": 0});
    if finish {
        c["finishReason"] = json!("STOP");
    }
    c
}

/// A generateContent answer, whole or streamed.
pub fn success(ctx: &Ctx) -> Response {
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
        "candidates": [candidate(CONTENT, true)],
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
                "candidates": [candidate(piece, last)],
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

fn status_name(status: u16) -> &'static str {
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

/// Gemini's error body for a failed request (quota errors are `quota`).
pub fn error(ctx: &Ctx) -> Value {
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
    json!({"error": {"code": status, "message": message, "status": status_name(status)}})
}

/// The per-minute or per-day quota error, with `RetryInfo` unless the scenario says none.
pub fn quota(ctx: &Ctx) -> Value {
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
