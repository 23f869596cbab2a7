//! What the simulator reads from a provider request: the route (dialect and endpoint, from the
//! path), the account key, the input-token estimate and the output limit.

use serde_json::Value;

use crate::dialect::Dialect;
use crate::http::Request;

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
