//! Which pool a request belongs to (README, `pools[].match`), and the dialect of the answers
//! the gateway gives itself (`pools[].dialect`, `auto` decided from the request).

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{header, Decision, Host};
use llm_governor_core::headers::{owned, Headers};
use llm_governor_core::policy::RequestView;
use serde_json::{json, Value};

/// The pool a request with this authority, path and headers is governed by.
fn pool_of(host: &mut Host, authority: &str, path: &str, headers: &[(&str, &str)]) -> String {
    let hs = owned(headers);
    let view = RequestView {
        path: path.as_bytes(),
        authority: authority.as_bytes(),
        headers: Headers::new(&hs),
    };
    let governor = host.governor();
    let flow = governor.pools().flow_for(&view);
    governor.cfg.pools[flow.pool].name.clone()
}

#[test]
fn authority_matches_exactly_and_case_insensitively() {
    let mut host = Host::new(
        r#"{"pools": [
          {"name": "azure-east", "match": {"authority": "east.openai.azure.com"}},
          {"name": "openai", "match": {"authority": "API.OpenAI.com", "path_prefix": "/v1/chat"}}
        ]}"#,
    );
    let chat = "/v1/chat/completions";
    assert_eq!(
        pool_of(&mut host, "east.openai.azure.com", chat, &[]),
        "azure-east"
    );
    assert_eq!(
        pool_of(&mut host, "EAST.OpenAI.Azure.COM", chat, &[]),
        "azure-east"
    );
    assert_eq!(pool_of(&mut host, "api.openai.com", chat, &[]), "openai");
    // Exact: no suffix, prefix or port matching.
    assert_eq!(
        pool_of(&mut host, "west.east.openai.azure.com", chat, &[]),
        "default"
    );
    assert_eq!(
        pool_of(&mut host, "east.openai.azure.com:443", chat, &[]),
        "default"
    );
    assert_eq!(
        pool_of(&mut host, "east.openai.azure.co", chat, &[]),
        "default"
    );
    // All given conditions must hold: the right authority on another path is not `openai`.
    assert_eq!(
        pool_of(&mut host, "api.openai.com", "/v1/embeddings", &[]),
        "default"
    );
}

#[test]
fn pools_match_in_order_and_the_rest_is_default() {
    let mut host = Host::new(
        r#"{"pools": [
          {"name": "batch", "match": {"path_prefix": "/v1/", "header": {"name": "x-lane", "value": "batch"}}},
          {"name": "openai", "match": {"path_prefix": "/v1/"}}
        ]}"#,
    );
    let lane = [("x-lane", "batch")];
    assert_eq!(
        pool_of(&mut host, "h", "/v1/chat/completions", &lane),
        "batch"
    );
    assert_eq!(
        pool_of(
            &mut host,
            "h",
            "/v1/chat/completions",
            &[("x-lane", "Batch")]
        ),
        "openai"
    );
    assert_eq!(
        pool_of(&mut host, "h", "/v1/chat/completions", &[]),
        "openai"
    );
    assert_eq!(pool_of(&mut host, "h", "/v2/chat", &lane), "default");
}

/// The JSON body of the local answer to a request while its (pool, account) cools.
fn local_body(host: &mut Host, path: &str, headers: &[(&str, &str)]) -> Value {
    let flow = host.forward(path, headers);
    host.respond(&flow, 429, &[("retry-after", "5")], "{}");
    match host.request(path, headers) {
        Decision::Reply(r) => {
            assert_eq!(r.status, 429);
            assert_eq!(header(&r.headers, "content-type"), "application/json");
            assert_eq!(header(&r.headers, "x-llm-governor-source"), "cooldown");
            serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{path}: {e}"))
        }
        Decision::Forward(_) => panic!("{path}: forwarded while cooling"),
    }
}

fn openai_shape(v: &Value) {
    let e = &v["error"];
    assert_eq!(e["type"], "rate_limit_error", "{v}");
    assert_eq!(e["code"], "rate_limit_exceeded", "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

fn anthropic_shape(v: &Value) {
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
}

fn gemini_shape(v: &Value) {
    let e = &v["error"];
    assert_eq!(e["code"], json!(429), "{v}");
    assert_eq!(e["status"], "RESOURCE_EXHAUSTED", "{v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

#[test]
fn configured_dialects_shape_local_bodies_including_gemini_and_azure() {
    let mut host = Host::new(
        r#"{"hold": {"max_ms": 0}, "pools": [
          {"name": "gemini", "match": {"path_prefix": "/v1beta/"}, "dialect": "gemini"},
          {"name": "azure", "match": {"path_prefix": "/openai/"}, "dialect": "azure_openai"},
          {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
          {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}
        ]}"#,
    );
    let gemini = local_body(
        &mut host,
        "/v1beta/models/gemini-2.0-flash:generateContent",
        &[("x-goog-api-key", "g")],
    );
    gemini_shape(&gemini);
    let azure = local_body(
        &mut host,
        "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
        &[("api-key", "z")],
    );
    openai_shape(&azure);
    anthropic_shape(&local_body(
        &mut host,
        "/v1/messages",
        &[("x-api-key", "a")],
    ));
    openai_shape(&local_body(
        &mut host,
        "/v1/chat/completions",
        &[("authorization", "Bearer o")],
    ));
    // A configured dialect is the pool's whatever the request looks like.
    let mut host = Host::new(
        r#"{"hold": {"max_ms": 0}, "pools": [{"name": "g", "match": {"path_prefix": "/"}, "dialect": "gemini"}]}"#,
    );
    gemini_shape(&local_body(
        &mut host,
        "/v1/messages",
        &[("x-api-key", "a"), ("anthropic-version", "2023-06-01")],
    ));
}

#[test]
fn auto_dialect_is_decided_from_the_request() {
    // No pools: everything is in `default`, dialect `auto`.
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], fn(&Value));
    let cases: [Case; 6] = [
        (
            "/v1/messages",
            &[("x-api-key", "a1"), ("anthropic-version", "2023-06-01")],
            anthropic_shape,
        ),
        // `anthropic-version` decides, whatever the path.
        (
            "/v1/chat/completions",
            &[
                ("authorization", "Bearer a2"),
                ("anthropic-version", "2023-06-01"),
            ],
            anthropic_shape,
        ),
        (
            "/v1beta/models/gemini-2.0-flash:generateContent",
            &[("authorization", "Bearer g1")],
            gemini_shape,
        ),
        (
            "/v1/models/gemini-pro",
            &[("x-goog-api-key", "g2")],
            gemini_shape,
        ),
        (
            "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            &[("api-key", "z")],
            openai_shape,
        ),
        (
            "/v1/chat/completions",
            &[("authorization", "Bearer o")],
            openai_shape,
        ),
    ];
    for (path, headers, shape) in cases {
        let mut host = Host::new(r#"{"hold": {"max_ms": 0}}"#);
        shape(&local_body(&mut host, path, headers));
    }
}
