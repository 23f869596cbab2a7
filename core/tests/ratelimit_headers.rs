//! The provider's rate-limit headers, as each provider sends them, read into one snapshot.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use llm_governor_core::headers::{owned, Headers};
use llm_governor_core::ratelimit::{parse, Dimension, Window};

const NOW: u64 = 1_796_055_600_000; // 2026-11-30T16:20:00Z

#[test]
fn openai_and_azure() {
    let hs = owned(&[
        ("x-ratelimit-limit-requests", "500"),
        ("x-ratelimit-remaining-requests", "499"),
        ("x-ratelimit-reset-requests", "120ms"),
        ("x-ratelimit-limit-tokens", "30000"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "6m0s"),
    ]);
    let s = parse(&Headers::new(&hs), &|| NOW);
    assert_eq!(
        s.requests,
        Window {
            limit: Some(500),
            remaining: Some(499),
            reset_ms: Some(120)
        }
    );
    assert_eq!(
        s.tokens,
        Window {
            limit: Some(30000),
            remaining: Some(0),
            reset_ms: Some(360_000)
        }
    );
    assert_eq!(s.exhausted().collect::<Vec<_>>(), [Dimension::Tokens]);
    assert_eq!(s.exhausted_reset_ms(), Some(360_000));
}

#[test]
fn anthropic_with_input_and_output_tokens() {
    let hs = owned(&[
        ("anthropic-ratelimit-requests-limit", "50"),
        ("anthropic-ratelimit-requests-remaining", "42"),
        ("anthropic-ratelimit-requests-reset", "2026-11-30T16:20:01Z"),
        ("anthropic-ratelimit-input-tokens-limit", "40000"),
        ("anthropic-ratelimit-input-tokens-remaining", "0"),
        (
            "anthropic-ratelimit-input-tokens-reset",
            "2026-11-30T16:20:12.5Z",
        ),
        ("anthropic-ratelimit-output-tokens-remaining", "8000"),
    ]);
    let s = parse(&Headers::new(&hs), &|| NOW);
    assert_eq!(
        s.requests,
        Window {
            limit: Some(50),
            remaining: Some(42),
            reset_ms: Some(1000)
        }
    );
    assert_eq!(s.input_tokens.reset_ms, Some(12_500));
    assert_eq!(s.output_tokens.remaining, Some(8000));
    assert_eq!(s.exhausted().collect::<Vec<_>>(), [Dimension::InputTokens]);
}

#[test]
fn ietf_structured_and_legacy_fields() {
    let hs = owned(&[
        ("ratelimit", "\"default\";r=7;t=30"),
        ("ratelimit-policy", "\"default\";q=100;w=60"),
    ]);
    let s = parse(&Headers::new(&hs), &|| NOW);
    assert_eq!(
        s.requests,
        Window {
            limit: Some(100),
            remaining: Some(7),
            reset_ms: Some(30_000)
        }
    );
    let hs = owned(&[
        ("ratelimit-limit", "10"),
        ("ratelimit-remaining", "0"),
        ("ratelimit-reset", "3"),
    ]);
    let s = parse(&Headers::new(&hs), &|| NOW);
    assert_eq!(
        s.requests,
        Window {
            limit: Some(10),
            remaining: Some(0),
            reset_ms: Some(3000)
        }
    );
}

#[test]
fn no_headers_no_snapshot() {
    let hs = owned(&[("content-type", "application/json")]);
    assert!(parse(&Headers::new(&hs), &|| NOW).is_empty());
}

#[test]
fn a_token_bucket_that_reports_empty_has_room_for_one_request_long_before_its_reset() {
    // OpenAI: 20,000 TPM, empty, full again in 60 s: 1,000 tokens are back after 3 s.
    let hs = owned(&[
        ("x-ratelimit-limit-tokens", "20000"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "60s"),
    ]);
    let s = llm_governor_core::ratelimit::parse(&Headers::new(&hs), &|| 0);
    assert_eq!(s.exhausted_reset_ms(), Some(60_000));
    assert_eq!(s.exhausted_wait_ms(Some(1_000)), Some(3_000));
    assert_eq!(
        s.exhausted_wait_ms(Some(50_000)),
        Some(60_000),
        "never past the reset"
    );
    assert_eq!(s.exhausted_wait_ms(Some(0)), Some(1));
}

/// Names in any case land in the same slot as lowercase ones, the first value of a name wins,
/// and names that only resemble a family's (a missing or extra word, a dimension of the other
/// family) fill nothing: through both header representations.
#[test]
fn names_match_in_any_case_first_value_wins_near_misses_ignored() {
    use llm_governor_core::headers::WireHeaders;
    let raw: Vec<(String, Vec<u8>)> = [
        ("X-RateLimit-Limit-Requests", "500"),
        ("x-ratelimit-limit-requests", "7"),
        ("X-RATELIMIT-REMAINING-TOKENS", "0"),
        ("x-ratelimit-Reset-Tokens", "2s"),
        ("x-ratelimit-limit", "1"),
        ("x-ratelimit--requests", "2"),
        ("x-ratelimit-limit-requestsx", "3"),
        ("x-ratelimit-limit-input-tokens", "4"),
        ("x-ratelimit-remaining-requests-", "5"),
        ("Anthropic-RateLimit-Output-Tokens-Remaining", "800"),
        ("anthropic-ratelimit-output-tokens-", "6"),
        ("anthropic-ratelimit-tokens", "7"),
        ("anthropic-ratelimit-outputtokens-limit", "8"),
        ("anthropic-ratelimit-requests-limit-x", "9"),
    ]
    .iter()
    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
    .collect();
    let wire = WireHeaders::parse(WireHeaders::encode(
        raw.iter().map(|(n, v)| (n.as_bytes(), v.as_slice())),
    ))
    .unwrap();
    for h in [Headers::new(&raw), Headers::wire(&wire)] {
        let s = parse(&h, &|| NOW);
        assert_eq!(
            s.requests,
            Window {
                limit: Some(500),
                remaining: None,
                reset_ms: None
            }
        );
        assert_eq!(
            s.tokens,
            Window {
                limit: None,
                remaining: Some(0),
                reset_ms: Some(2000)
            }
        );
        assert_eq!(s.input_tokens, Window::default());
        assert_eq!(
            s.output_tokens,
            Window {
                limit: None,
                remaining: Some(800),
                reset_ms: None
            }
        );
    }
}

/// Preemptive pacing per dimension (issue 32): each dimension Anthropic reports used up is
/// paced by what a request like this one needs of that dimension, one row per case.
#[test]
fn each_used_up_dimension_waits_for_what_the_request_needs_of_it() {
    use llm_governor_core::ratelimit::Need;
    // Input used up (20,000 a minute, full again in 60 s); output has room.
    let hs = owned(&[
        ("anthropic-ratelimit-input-tokens-limit", "20000"),
        ("anthropic-ratelimit-input-tokens-remaining", "0"),
        (
            "anthropic-ratelimit-input-tokens-reset",
            "2026-11-30T16:21:00Z",
        ),
        ("anthropic-ratelimit-output-tokens-limit", "6000"),
        ("anthropic-ratelimit-output-tokens-remaining", "3000"),
        (
            "anthropic-ratelimit-output-tokens-reset",
            "2026-11-30T16:20:30Z",
        ),
    ]);
    let s = parse(&Headers::new(&hs), &|| NOW);
    let need = |tokens, input_tokens, output_tokens| Need {
        tokens,
        input_tokens,
        output_tokens,
    };
    let rows: [(&str, Need, Option<u64>); 5] = [
        (
            "its input back",
            need(None, Some(2_000), Some(300)),
            Some(6_000),
        ),
        (
            "the whole reset when the input need is unknown",
            need(None, None, Some(300)),
            Some(60_000),
        ),
        (
            "a total need does not pace the input dimension",
            need(Some(2_000), None, None),
            Some(60_000),
        ),
        (
            "never past the reset",
            need(None, Some(50_000), None),
            Some(60_000),
        ),
        // Output has 3,000 left: a request needing more is not cooled (the bucket paces it).
        (
            "room left is not used up",
            need(None, Some(1), Some(4_000)),
            Some(3),
        ),
    ];
    for (name, need, wait) in rows {
        assert_eq!(s.short_wait_ms(&need), wait, "{name}");
    }
    let no_input = owned(&[("anthropic-ratelimit-output-tokens-remaining", "7")]);
    let s = parse(&Headers::new(&no_input), &|| NOW);
    assert_eq!(s.short_wait_ms(&need(None, Some(5), Some(5))), None);
}
