//! Real provider error responses (headers and bodies as the providers send them) and what the
//! client must be told for each.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{header, Host, T0};
use llm_governor_core::headers::owned;

const POOLS: &str = r#"{
  "pools": [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
    {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
    {"name": "azure", "match": {"path_prefix": "/openai/"}, "dialect": "azure_openai"},
    {"name": "gemini", "match": {"path_prefix": "/v1beta/"}, "dialect": "gemini"}
  ],
  "cooldown": {"enabled": false}
}"#;

const OPENAI_RATE_LIMIT: &str = r#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on requests per min (RPM): Limit 500, Used 500, Requested 1. Please try again in 120ms.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
const OPENAI_TOKENS: &str = r#"{"error":{"message":"Rate limit reached for gpt-4o on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
const OPENAI_QUOTA: &str = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
const ANTHROPIC_RATE_LIMIT: &str = r#"{"type":"error","error":{"type":"rate_limit_error","message":"This request would exceed the rate limit for your organization of 50 requests per minute."}}"#;
const ANTHROPIC_SPEND: &str = r#"{"type":"error","error":{"type":"rate_limit_error","message":"You have reached your specified workspace API usage limits."},"error_code":"enforced_spend_limit_reached"}"#;
const ANTHROPIC_OVERLOADED: &str =
    r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
const GEMINI_MINUTE: &str = r#"{"error":{"code":429,"message":"You exceeded your current quota.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier","quotaValue":"15"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"17s"}]}}"#;
const GEMINI_DAY: &str = r#"{"error":{"code":429,"message":"You exceeded your current quota.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier","quotaValue":"1500"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"43s"}]}}"#;
const AZURE_RATE_LIMIT: &str = r#"{"error":{"code":"429","message":"Requests to the ChatCompletions_Create Operation under Azure OpenAI API version 2024-10-21 have exceeded call rate limit of your current OpenAI S0 pricing tier. Please retry after 6 seconds."}}"#;

struct Case {
    name: &'static str,
    path: &'static str,
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    body: &'static str,
    class: &'static str,
    /// The provider's own delay in ms; None when the backoff applies.
    provider_ms: Option<u64>,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "openai rate limit, retry-after-ms wins over retry-after",
            path: "/v1/chat/completions",
            status: 429,
            headers: &[
                ("retry-after-ms", "1234"),
                ("retry-after", "9"),
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "20s"),
            ],
            body: OPENAI_RATE_LIMIT,
            class: "rate_limited",
            provider_ms: Some(1234),
        },
        Case {
            name: "openai rate limit, retry-after seconds",
            path: "/v1/chat/completions",
            status: 429,
            headers: &[("retry-after", "2")],
            body: OPENAI_RATE_LIMIT,
            class: "rate_limited",
            provider_ms: Some(2000),
        },
        Case {
            name: "openai rate limit, only reset headers (requests exhausted)",
            path: "/v1/chat/completions",
            status: 429,
            headers: &[
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "1m30.5s"),
                ("x-ratelimit-remaining-tokens", "29000"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ],
            body: OPENAI_RATE_LIMIT,
            class: "rate_limited",
            provider_ms: Some(90_500),
        },
        Case {
            name: "openai tokens: body names the dimension, remaining not zero",
            path: "/v1/chat/completions",
            status: 429,
            headers: &[
                ("x-ratelimit-remaining-requests", "499"),
                ("x-ratelimit-reset-requests", "120ms"),
                ("x-ratelimit-remaining-tokens", "1000"),
                ("x-ratelimit-reset-tokens", "1.5s"),
            ],
            body: OPENAI_TOKENS,
            class: "rate_limited",
            provider_ms: Some(1500),
        },
        Case {
            name: "openai insufficient_quota",
            path: "/v1/chat/completions",
            status: 429,
            headers: &[],
            body: OPENAI_QUOTA,
            class: "quota_exhausted",
            provider_ms: None,
        },
        Case {
            name: "anthropic rate limit with retry-after",
            path: "/v1/messages",
            status: 429,
            headers: &[
                ("retry-after", "7"),
                ("anthropic-ratelimit-requests-remaining", "0"),
                ("anthropic-ratelimit-requests-reset", "2026-11-30T16:20:30Z"),
            ],
            body: ANTHROPIC_RATE_LIMIT,
            class: "rate_limited",
            provider_ms: Some(7000),
        },
        Case {
            name: "anthropic rate limit, only RFC 3339 reset",
            path: "/v1/messages",
            status: 429,
            headers: &[
                ("anthropic-ratelimit-requests-remaining", "0"),
                ("anthropic-ratelimit-requests-reset", "2026-11-30T16:20:05Z"),
                ("anthropic-ratelimit-tokens-remaining", "5000"),
                ("anthropic-ratelimit-tokens-reset", "2026-11-30T16:21:00Z"),
            ],
            body: ANTHROPIC_RATE_LIMIT,
            class: "rate_limited",
            provider_ms: Some(5000),
        },
        Case {
            name: "anthropic spend cap",
            path: "/v1/messages",
            status: 429,
            headers: &[],
            body: ANTHROPIC_SPEND,
            class: "quota_exhausted",
            provider_ms: None,
        },
        Case {
            name: "anthropic 529 overloaded",
            path: "/v1/messages",
            status: 529,
            headers: &[],
            body: ANTHROPIC_OVERLOADED,
            class: "overloaded",
            provider_ms: None,
        },
        Case {
            name: "503 with retry-after HTTP-date",
            path: "/v1/chat/completions",
            status: 503,
            headers: &[("retry-after", "Mon, 30 Nov 2026 16:20:10 GMT")],
            body: "",
            class: "overloaded",
            provider_ms: Some(10_000),
        },
        Case {
            name: "gemini per-minute with RetryInfo",
            path: "/v1beta/models/gemini-2.0-flash:generateContent",
            status: 429,
            headers: &[],
            body: GEMINI_MINUTE,
            class: "rate_limited",
            provider_ms: Some(17_000),
        },
        Case {
            name: "gemini per-day",
            path: "/v1beta/models/gemini-2.0-flash:generateContent",
            status: 429,
            headers: &[],
            body: GEMINI_DAY,
            class: "quota_exhausted",
            provider_ms: Some(43_000),
        },
        Case {
            name: "azure with retry-after-ms",
            path: "/openai/deployments/gpt4o/chat/completions?api-version=2024-10-21",
            status: 429,
            headers: &[("retry-after", "6"), ("retry-after-ms", "5500")],
            body: AZURE_RATE_LIMIT,
            class: "rate_limited",
            provider_ms: Some(5500),
        },
    ]
}

#[test]
fn every_provider_response_is_classified_and_timed() {
    for case in cases() {
        let mut host = Host::new(POOLS);
        let flow = host.forward(case.path, &[("authorization", "Bearer sk-test")]);
        let Some(g) = host.respond(&flow, case.status, case.headers, case.body) else {
            panic!("{}: not governed", case.name);
        };
        assert_eq!(g.class.as_str(), case.class, "{}", case.name);
        assert_eq!(
            header(&g.headers, "x-llm-governor-class"),
            case.class,
            "{}",
            case.name
        );
        assert_eq!(
            header(&g.headers, "x-llm-governor-source"),
            "upstream",
            "{}",
            case.name
        );
        let should_retry = if case.class == "quota_exhausted" {
            "false"
        } else {
            "true"
        };
        assert_eq!(
            header(&g.headers, "x-should-retry"),
            should_retry,
            "{}",
            case.name
        );
        let ms: u64 = header(&g.headers, "retry-after-ms").parse().unwrap_or(0);
        let secs: u64 = header(&g.headers, "retry-after").parse().unwrap_or(0);
        assert_eq!(
            secs,
            ms.div_ceil(1000),
            "{}: retry-after rounds up",
            case.name
        );
        // With the random value fixed at 0 (no jitter, the backoff's lowest value), what the
        // client is told is known exactly: the provider's time; for a quota answer without
        // one, cooldown.quota_ms (300 s); for an overload without one, the backoff's 1 ms;
        // all capped by retry_after.max_ms (60 s).
        let expected = match (case.provider_ms, case.class) {
            (Some(p), _) => p,
            (None, "quota_exhausted") => 300_000,
            (None, _) => 1,
        }
        .min(60_000);
        assert_eq!(ms, expected, "{}", case.name);
    }
}

/// A unit test of the response room, without the worker: the provider's own time it read from
/// each response (the client only sees what it is told, which the test above checks).
#[test]
fn the_response_room_reads_each_providers_own_time() {
    for case in cases() {
        let mut host = Host::new(POOLS);
        let flow = host.forward(case.path, &[("authorization", "Bearer sk-test")]);
        let hs = owned(case.headers);
        let g = host.response_room(&flow, case.status, &hs, case.body.as_bytes());
        let g = g.unwrap_or_else(|| panic!("{}: not governed", case.name));
        assert_eq!(g.provider_ms, case.provider_ms, "{}", case.name);
    }
    // The "try again in 120ms" of OpenAI's message is prose, not a time: a hint-less 429 (the
    // backoff test below, on the default pool).
    let mut host = Host::new(r#"{"retry_after": {"default_ms": 1000, "max_ms": 60000}}"#);
    let flow = host.forward("/v1/chat/completions", &[("authorization", "Bearer k")]);
    let g = host.response_room(&flow, 429, &[], OPENAI_RATE_LIMIT.as_bytes());
    assert_eq!(g.map(|g| g.provider_ms), Some(None));
}

#[test]
fn jitter_is_added_on_top_never_below() {
    for (u, expected) in [(0.0, 2000), (0.5, 2200), (0.999_999, 2399)] {
        let mut host = Host::new(POOLS);
        host.rng.set(u);
        let flow = host.forward("/v1/chat/completions", &[]);
        let g = host.respond(&flow, 429, &[("retry-after", "2")], OPENAI_RATE_LIMIT);
        let g = g.unwrap_or_else(|| panic!("not governed"));
        assert_eq!(g.delay_ms, expected, "u={u}");
    }
}

#[test]
fn cap_shortens_what_clients_are_told() {
    let mut host = Host::new(r#"{"retry_after": {"max_ms": 5000}}"#);
    host.rng.set(0.9);
    let flow = host.forward("/v1/chat/completions", &[]);
    let g = host.respond(&flow, 429, &[("retry-after", "30")], OPENAI_RATE_LIMIT);
    assert_eq!(g.map(|g| g.delay_ms), Some(5000));
}

/// README, `retry_after.default_ms`: the backoff of the n-th consecutive hint-less rate limit,
/// counting from n = 0 for the first, is uniform in [1, min(max_ms, default_ms * 2^n)]: the
/// first one is told at most `default_ms`, the base, and each one after it doubles the
/// ceiling. A success starts over at n = 0.
#[test]
fn backoff_starts_at_default_ms_and_doubles_with_each_consecutive_hintless_rate_limit() {
    // Ceilings 1000, 2000, ..., 32000, then max_ms (64000 > 60000).
    for (u, expected) in [
        (
            0.999_999,
            [999, 1999, 3999, 7999, 15999, 31999, 59999, 59999],
        ),
        (0.5, [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000]),
        (0.0, [1; 8]),
    ] {
        let mut host = Host::new(r#"{"retry_after": {"default_ms": 1000, "max_ms": 60000}}"#);
        host.rng.set(u);
        let mut told = Vec::new();
        for _ in 0..8 {
            let flow = host.forward("/v1/chat/completions", &[("authorization", "Bearer k")]);
            let g = host.respond(&flow, 429, &[], OPENAI_RATE_LIMIT);
            told.push(g.map(|g| g.delay_ms).unwrap_or(0));
        }
        assert_eq!(told, expected, "u={u}");
        let flow = host.forward("/v1/chat/completions", &[("authorization", "Bearer k")]);
        assert!(host.respond(&flow, 200, &[], "{}").is_none());
        let flow = host.forward("/v1/chat/completions", &[("authorization", "Bearer k")]);
        let g = host.respond(&flow, 429, &[], OPENAI_RATE_LIMIT);
        assert_eq!(
            g.map(|g| g.delay_ms),
            Some(expected[0]),
            "u={u}: after a success"
        );
    }
}

#[test]
fn errors_that_are_not_rate_limits_pass_untouched() {
    for status in [200, 201, 400, 401, 403, 404, 413, 500, 502, 504] {
        let mut host = Host::new(POOLS);
        let flow = host.forward("/v1/chat/completions", &[]);
        assert!(
            host.respond(&flow, status, &[("retry-after", "5")], OPENAI_QUOTA)
                .is_none(),
            "{status}"
        );
        assert!(
            host.metrics.counters.is_empty(),
            "{status}: {:?}",
            host.metrics.counters
        );
    }
}

#[test]
fn counters_and_histogram_per_pool() {
    use llm_governor_core::metrics::Counter;
    let mut host = Host::new(POOLS);
    let flow = host.forward("/v1/messages", &[]);
    host.respond(&flow, 529, &[("retry-after", "3")], ANTHROPIC_OVERLOADED);
    let flow = host.forward("/v1/chat/completions", &[]);
    host.respond(&flow, 429, &[], OPENAI_QUOTA);
    assert_eq!(host.metrics.count_of(1, Counter::UpstreamOverloaded), 1);
    assert_eq!(host.metrics.count_of(0, Counter::UpstreamQuotaExhausted), 1);
    assert_eq!(host.metrics.histogram.len(), 2);
    assert_eq!(host.metrics.histogram[0], (1, 3000));
    let _ = T0;
}
