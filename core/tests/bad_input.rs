//! Untrusted header and body bytes: each is used safely or ignored, never a panic, and a
//! client is never told less than 1 ms or more than the cap.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::reactions::{told, Told};
use common::{header, Decision, Host};
use llm_governor_core::headers::{owned, Headers};
use llm_governor_core::ratelimit;

/// (header, value) pairs that must be ignored as delay sources.
const IGNORED: &[(&str, &[u8])] = &[
    ("retry-after", b""),
    ("retry-after", b"   "),
    ("retry-after", b"-5"),
    ("retry-after", b"NaN"),
    ("retry-after", b"inf"),
    ("retry-after", b"0x10"),
    ("retry-after", b"1e3"),
    ("retry-after", b"0"),
    ("retry-after", b"Thu, 01 Jan 1970 00:00:00 GMT"),
    ("retry-after", b"Mon, 32 Foo 2026 99:99:99 GMT"),
    ("retry-after", b"\xff\xfe\xfd"),
    ("retry-after-ms", b"-1"),
    ("retry-after-ms", b"nan"),
    ("retry-after-ms", b"1,5"),
    ("retry-after-ms", b"\x00"),
    ("x-ratelimit-reset-requests", b"-1s"),
    ("x-ratelimit-reset-requests", b"6x"),
    ("x-ratelimit-reset-requests", b"s"),
    (
        "anthropic-ratelimit-requests-reset",
        b"2026-02-30T99:00:00Z",
    ),
    (
        "anthropic-ratelimit-requests-reset",
        b"2020-01-01T00:00:00Z",
    ),
    ("anthropic-ratelimit-requests-reset", b"yesterday"),
];

#[test]
fn malformed_delay_values_fall_through_to_the_backoff() {
    for (name, value) in IGNORED {
        let mut host = Host::new(r#"{"retry_after": {"default_ms": 1000}}"#);
        host.rng.set(0.5);
        let flow = host.forward("/v1/chat/completions", &[]);
        let mut hs = owned(&[("x-ratelimit-remaining-requests", "0")]);
        hs.push((name.to_string(), value.to_vec()));
        let told = respond_raw(&mut host, &flow, 429, &hs, b"{}");
        assert_eq!(told.delay_ms, 500, "{name}: {value:?}");
    }
}

/// A unit test of the response room, without the worker: none of the malformed values is
/// read as the provider's time (the client sees only the backoff, above).
#[test]
fn the_response_room_trusts_no_malformed_delay_value() {
    for (name, value) in IGNORED {
        let mut host = Host::new(r#"{"retry_after": {"default_ms": 1000}}"#);
        let flow = host.forward("/v1/chat/completions", &[]);
        let mut hs = owned(&[("x-ratelimit-remaining-requests", "0")]);
        hs.push((name.to_string(), value.to_vec()));
        let g = host.response_room(&flow, 429, &hs, b"{}");
        let g = g.unwrap_or_else(|| panic!("{name}: {value:?}: not governed"));
        assert_eq!(g.provider_ms, None, "{name}: {value:?} was trusted");
    }
}

#[test]
fn huge_and_far_future_values_are_capped() {
    for (name, value) in [
        ("retry-after", "99999999999999999999999999"),
        ("retry-after-ms", "18446744073709551616"),
        ("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"),
        ("x-ratelimit-reset-requests", "99999999h"),
    ] {
        let mut host = Host::new("{}");
        let flow = host.forward("/v1/chat/completions", &[]);
        let hs = owned(&[(name, value), ("x-ratelimit-remaining-requests", "0")]);
        let g = respond_raw(&mut host, &flow, 429, &hs, b"");
        assert_eq!(g.delay_ms, 60_000, "{name}: {value}");
        assert_eq!(header(&g.headers, "retry-after"), "60");
    }
}

#[test]
fn duplicated_headers_use_the_first() {
    let mut host = Host::new("{}");
    let flow = host.forward("/v1/chat/completions", &[]);
    let hs = owned(&[("retry-after", "3"), ("retry-after", "50")]);
    // The first's 3 s (no jitter with the random value 0).
    assert_eq!(respond_raw(&mut host, &flow, 429, &hs, b"").delay_ms, 3000);
}

/// A unit test of the response room, without the worker: the provider's time it read of
/// duplicated headers.
#[test]
fn the_response_room_reads_the_first_of_duplicated_headers() {
    let mut host = Host::new("{}");
    let flow = host.forward("/v1/chat/completions", &[]);
    let hs = owned(&[("retry-after", "3"), ("retry-after", "50")]);
    let g = host.response_room(&flow, 429, &hs, b"");
    assert_eq!(g.and_then(|g| g.provider_ms), Some(3000));
}

/// Bodies that hold nothing a classifier or a delay parser should trust.
fn hostile_bodies() -> Vec<Vec<u8>> {
    vec![
        vec![],
        b"{".to_vec(),
        b"{\"error\":{\"code\":\"insufficient_qu".to_vec(),
        b"\"retryDelay\"".to_vec(),
        b"\"retryDelay\":".to_vec(),
        b"\"retryDelay\": \"-5s\"".to_vec(),
        b"\"retryDelay\": \"NaNs\"".to_vec(),
        b"\"quotaId\": ".to_vec(),
        b"RESOURCE_EXHAUSTED \"quotaId\":\"\\u0050erDay\"".to_vec(),
        vec![0xff; 20_000],
        "\u{1F600}".repeat(1000).into_bytes(),
        b"\"type\":".repeat(5000),
    ]
}

#[test]
fn hostile_bodies_never_panic() {
    for body in hostile_bodies() {
        let mut host = Host::new("{}");
        let flow = host.forward("/v1beta/models/x:generateContent", &[]);
        let g = respond_raw(&mut host, &flow, 429, &[], &body);
        // Nothing in them is a delay or a quota marker: a rate limit without a hint, told the
        // backoff's value for the fixed random value 0, which is its floor of 1 ms.
        let shown = String::from_utf8_lossy(&body[..body.len().min(40)]).into_owned();
        assert_eq!(g.class.as_str(), "rate_limited", "{shown}");
        assert_eq!(g.delay_ms, 1, "{shown}");
    }
}

/// A unit test of the response room, without the worker: the whole of each hostile body (the
/// worker reads at most `MAX_ERROR_BODY` of it) is read without a panic, and none holds a
/// provider time.
#[test]
fn the_response_room_reads_whole_hostile_bodies_and_finds_no_time() {
    for body in hostile_bodies() {
        let mut host = Host::new("{}");
        let flow = host.forward("/v1beta/models/x:generateContent", &[]);
        let g = host.response_room(&flow, 429, &[], &body);
        let shown = String::from_utf8_lossy(&body[..body.len().min(40)]).into_owned();
        let g = g.unwrap_or_else(|| panic!("{shown}: not governed"));
        assert_eq!(g.provider_ms, None, "{shown}");
        assert_eq!(g.class.as_str(), "rate_limited", "{shown}");
        assert_eq!(g.delay_ms, 1, "{shown}");
    }
}

#[test]
fn truncated_quota_body_still_classifies() {
    let mut host = Host::new("{}");
    let flow = host.forward("/v1/chat/completions", &[]);
    let body = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","par"#;
    assert_eq!(
        respond_raw(&mut host, &flow, 429, &[], body).class.as_str(),
        "quota_exhausted"
    );
}

#[test]
fn rate_limit_gauges_ignore_garbage() {
    let hs = owned(&[
        ("x-ratelimit-remaining-requests", "-1"),
        ("x-ratelimit-limit-requests", "12abc"),
        ("x-ratelimit-remaining-tokens", "99999999999999999999999"),
        ("ratelimit", "\"default\";r=;t=x"),
    ]);
    let snap = ratelimit::parse(&Headers::new(&hs), &|| common::T0);
    assert_eq!(snap.requests.remaining, None);
    assert_eq!(snap.requests.limit, None);
    assert_eq!(snap.tokens.remaining, Some(u64::MAX));
}

/// What the client is told of a response of any bytes, through the worker.
fn respond_raw(
    host: &mut Host,
    flow: &common::Sent,
    status: u16,
    hs: &[(String, Vec<u8>)],
    body: &[u8],
) -> Told {
    let reactions = host.response_wire(flow, status, hs, body);
    told(&reactions).unwrap_or_else(|| panic!("status {status} not governed"))
}

/// The policy reads the host's clock only when it needs the time: never for a plain
/// success (nothing cools, nothing is paced) and for a request nothing cools, once for an
/// answer that starts a cooldown (timed from that reading) and for a request it then refuses.
#[test]
fn the_clock_is_read_only_when_the_answer_needs_it() {
    let mut host = Host::new("{}");
    let mut next = 0;
    // Each request a stream of its own, through the worker from headers to end.
    let mut respond = |host: &mut Host, status: u16, hs: &[(&str, &str)]| {
        next += 1;
        host.arrive(
            next,
            "/v1/chat/completions",
            &[("authorization", "Bearer k")],
        );
        host.response(next, status, hs, "");
        host.end(next);
    };
    let reads = |host: &Host| host.clock_reads.get();
    let ask =
        |host: &mut Host| host.request("/v1/chat/completions", &[("authorization", "Bearer k")]);
    assert!(matches!(ask(&mut host), Decision::Forward(_)));
    assert_eq!(reads(&host), 0, "a request nothing cools read the clock");
    let plenty = [
        ("x-ratelimit-remaining-requests", "99"),
        ("x-ratelimit-reset-requests", "6ms"),
    ];
    respond(&mut host, 200, &plenty);
    respond(&mut host, 201, &[]);
    assert_eq!(reads(&host), 0, "a plain success read the clock");
    // The provider says nothing is left: a preemptive cooldown, timed from one reading.
    let empty = [
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "2s"),
    ];
    respond(&mut host, 200, &empty);
    assert_eq!(reads(&host), 1);
    match host.request("/v1/chat/completions", &[("authorization", "Bearer k")]) {
        Decision::Reply(r) => assert_eq!(r.status, 429),
        other => panic!("expected a local 429 during the cooldown, got {other:?}"),
    }
    // A request of the cooling account needs the time to compare with the cooldown's end.
    let before = reads(&host);
    assert!(matches!(ask(&mut host), Decision::Reply(..)));
    assert_eq!(
        reads(&host),
        before + 1,
        "one reading for a refused request"
    );
    host.advance(2_001);
    assert!(matches!(
        host.request("/v1/chat/completions", &[("authorization", "Bearer k")]),
        Decision::Forward(_)
    ));
}
