//! Azure OpenAI's answers: OpenAI's rate-limit headers with Azure's ids, and Azure's own error
//! bodies (the rest are OpenAI's).

use serde_json::{json, Value};

use super::ids::uuid;
use super::request::Endpoint;
use super::{openai, secs_ceil, Ctx};
use crate::decision::{Decision, Outcome, Reason};
use crate::http::Response;
use crate::scenario::Dimension;

/// Azure OpenAI's headers on every answer: OpenAI's rate limits, then Azure's ids and region.
pub fn headers(resp: &mut Response, d: &Decision) {
    openai::ratelimit_headers(resp, d);
    resp.header("apim-request-id", uuid());
    resp.header("x-request-id", uuid());
    resp.header("x-ms-region", "Sweden Central");
}

/// Azure's own error bodies; the others are OpenAI's.
pub fn error(ctx: &Ctx) -> Value {
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
        _ => openai::error(ctx),
    }
}
