//! What docs/observability.md promises about the `exhausted_*` counters and the gauges fed by
//! the IETF rate-limit fields.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::Host;
use llm_governor_core::metrics::{Counter, Gauge};
use llm_governor_core::ratelimit::Dimension;

const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";
const POOLS: &str = r#"{"cooldown": {"enabled": false}, "pools": [
  {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
  {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"}
]}"#;

/// The `exhausted_*` counters one 429 moved, by dimension.
fn exhausted_after(path: &str, headers: &[(&str, &str)], body: &str) -> Vec<Dimension> {
    let mut host = Host::new(POOLS);
    let f = host.forward(path, &[]);
    assert!(host.respond(&f, 429, headers, body).is_some());
    host.metrics
        .counters
        .iter()
        .filter_map(|(_, c)| match c {
            Counter::Exhausted(d) => Some(*d),
            _ => None,
        })
        .collect()
}

#[test]
fn the_dimension_with_the_longest_reset_is_counted_when_several_ran_out() {
    let openai = [
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "2s"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "30s"),
    ];
    assert_eq!(exhausted_after(CHAT, &openai, "{}"), [Dimension::Tokens]);
    let openai = [
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "1m"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "30s"),
    ];
    assert_eq!(exhausted_after(CHAT, &openai, "{}"), [Dimension::Requests]);
    // T0 is 16:20:00Z.
    let anthropic = [
        ("anthropic-ratelimit-requests-remaining", "0"),
        ("anthropic-ratelimit-requests-reset", "2026-11-30T16:20:05Z"),
        ("anthropic-ratelimit-input-tokens-remaining", "0"),
        (
            "anthropic-ratelimit-input-tokens-reset",
            "2026-11-30T16:20:40Z",
        ),
        ("anthropic-ratelimit-output-tokens-remaining", "0"),
        (
            "anthropic-ratelimit-output-tokens-reset",
            "2026-11-30T16:20:20Z",
        ),
    ];
    assert_eq!(
        exhausted_after(MESSAGES, &anthropic, "{}"),
        [Dimension::InputTokens]
    );
}

#[test]
fn the_openai_body_names_the_dimension_when_no_header_is_at_zero() {
    let body = r#"{"error":{"message":"Rate limit reached on tokens per min","type":"tokens","code":"rate_limit_exceeded"}}"#;
    let h = [("x-ratelimit-remaining-tokens", "1000")];
    assert_eq!(exhausted_after(CHAT, &h, body), [Dimension::Tokens]);
}

#[test]
fn a_429_with_nothing_recognisable_counts_none() {
    for (path, headers, body) in [
        (CHAT, &[][..], ""),
        (CHAT, &[("retry-after", "3")][..], "{}"),
        (
            CHAT,
            &[("x-ratelimit-remaining-requests", "7")][..],
            r#"{"error":{"type":"server","code":"x"}}"#,
        ),
        (
            MESSAGES,
            &[][..],
            r#"{"type":"error","error":{"type":"rate_limit_error","message":"x"}}"#,
        ),
    ] {
        let got = exhausted_after(path, headers, body);
        assert!(got.is_empty(), "{headers:?} {body}: counted {got:?}");
    }
    // At 0 without a reset to rank it by is still recognisable: that dimension ran out.
    let at_zero = [("x-ratelimit-remaining-requests", "0")];
    assert_eq!(
        exhausted_after(CHAT, &at_zero, "not json"),
        [Dimension::Requests]
    );
}

/// The request gauges a 200 with these headers sets on pool 0.
fn request_gauges(headers: &[(&str, &str)]) -> (Option<u64>, Option<u64>, Option<u64>) {
    let mut host = Host::new(POOLS);
    let f = host.forward(CHAT, &[]);
    assert!(host.respond(&f, 200, headers, "{}").is_none());
    let g = |gauge| host.metrics.last_gauge(0, gauge);
    (
        g(Gauge::LimitRequests),
        g(Gauge::RemainingRequests),
        g(Gauge::ResetRequestsMs),
    )
}

#[test]
fn ietf_fields_fill_the_request_gauges_only_when_no_provider_family_did() {
    let ietf = [
        ("ratelimit", r#""default";r=50;t=30"#),
        ("ratelimit-policy", r#""default";q=100;w=60"#),
    ];
    assert_eq!(request_gauges(&ietf), (Some(100), Some(50), Some(30_000)));
    let older = [
        ("ratelimit-limit", "100"),
        ("ratelimit-remaining", "40"),
        ("ratelimit-reset", "12"),
    ];
    assert_eq!(request_gauges(&older), (Some(100), Some(40), Some(12_000)));
    // With OpenAI's or Anthropic's request headers present, the IETF fields are not read.
    let mut both = ietf.to_vec();
    both.extend([
        ("x-ratelimit-limit-requests", "500"),
        ("x-ratelimit-remaining-requests", "499"),
        ("x-ratelimit-reset-requests", "120ms"),
    ]);
    assert_eq!(request_gauges(&both), (Some(500), Some(499), Some(120)));
    let mut both = ietf.to_vec();
    both.push(("anthropic-ratelimit-requests-remaining", "7"));
    assert_eq!(request_gauges(&both), (None, Some(7), None));
}
