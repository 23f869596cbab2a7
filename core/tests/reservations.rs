//! Token budgets that reserve before the call (issue 12): the estimate is taken from the
//! bucket before forwarding, settled with the reported usage at the end, given back when the
//! provider answers an error, and a request that can never fit is refused for good.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::provider::PATH;
use common::Decision;
use common::{header, Host};
use llm_governor_core::cooldown::CLOCK_GRAIN_MS as GRAIN;
use llm_governor_core::estimate;
use llm_governor_core::keys;
use llm_governor_core::store::SharedStore;

/// One token limit on the pool, settled with usage unless `extra` says otherwise.
fn config(extra: &str) -> String {
    let settle = if extra.contains("settle") || extra.contains("reserve") {
        ""
    } else {
        r#", "settle": "usage""#
    };
    format!(
        r#"{{"limits": [{{"name": "tpm", "key": "pool", "tokens_per_minute": 6000, "burst": 3000{settle}{extra}}}]}}"#
    )
}

/// An OpenAI chat body: `words` words of prose and, when given, `max_tokens`.
fn chat(words: usize, max_tokens: Option<&str>) -> Vec<u8> {
    let text = vec!["lorem"; words].join(" ");
    let max = max_tokens.map_or(String::new(), |m| format!(r#","max_tokens":{m}"#));
    format!(r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{text}"}}]{max}}}"#)
        .into_bytes()
}

fn input_of(body: &[u8]) -> u64 {
    estimate::estimate(body, body.len()).input
}

/// Whole tokens in the `default` pool's bucket of limit `tpm` (key `pool`), brought up to now.
fn level(host: &Host, key_id: u64) -> i64 {
    host.bucket_tokens(0, key_id).expect("bucket exists")
}

fn pool_id() -> u64 {
    common::test_key().id(b"default")
}

#[test]
fn the_estimate_and_the_output_limit_are_taken_before_forwarding() {
    let mut host = Host::new(&config(""));
    let body = chat(100, Some("200"));
    let reserved = input_of(&body) + 200;
    assert!(
        (100..=130).contains(&input_of(&body)),
        "{}",
        input_of(&body)
    );
    let flow = host.forward_with_body(PATH, &[], &body);
    assert_eq!(flow.charges.len(), 1);
    assert_eq!(flow.charges[0].reserved, reserved);
    assert_eq!(level(&host, pool_id()), 3000 - reserved as i64);
}

#[test]
fn a_reservation_that_does_not_fit_waits_for_the_refill_it_needs() {
    let mut host = Host::new(&config(""));
    let body = chat(100, Some("900"));
    let reserved = input_of(&body) + 900;
    let n = 3000 / reserved;
    for _ in 0..n {
        host.forward_with_body(PATH, &[], &body);
    }
    let left = 3000 - n * reserved;
    match host.request_with_body(PATH, &[], &body) {
        Decision::Reply(r) => {
            assert_eq!(r.status, 429);
            assert_eq!(header(&r.headers, "x-should-retry"), "true");
            assert_eq!(header(&r.headers, "x-llm-governor-source"), "limit");
            // The tokens missing, at 100 a second.
            let wait_ms = (reserved - left) * 10;
            assert_eq!(header(&r.headers, "retry-after-ms"), wait_ms.to_string());
            host.advance(wait_ms - 1);
            assert!(matches!(
                host.request_with_body(PATH, &[], &body),
                Decision::Reply(..)
            ));
            host.advance(1);
            host.forward_with_body(PATH, &[], &body);
        }
        Decision::Forward(_) => panic!("admitted past the budget"),
    }
}

#[test]
fn usage_replaces_the_reservation_refunding_or_charging_the_difference() {
    let mut host = Host::new(&config(""));
    let body = chat(50, Some("500"));
    let reserved = input_of(&body) + 500;
    let a = host.forward_with_body(PATH, &[], &body);
    let b = host.forward_with_body(PATH, &[], &body);
    assert_eq!(level(&host, pool_id()), 3000 - 2 * reserved as i64);
    // a used less than it reserved: the rest comes back.
    host.end_with_usage(&a, 100);
    assert_eq!(level(&host, pool_id()), 3000 - reserved as i64 - 100);
    // b used more (a longer answer than estimated): the difference is charged.
    host.end_with_usage(&b, reserved + 300);
    assert_eq!(level(&host, pool_id()), 3000 - 100 - reserved as i64 - 300);
    // Settled once: a second end changes nothing.
    host.end(&b);
    assert_eq!(level(&host, pool_id()), 3000 - 100 - reserved as i64 - 300);
}

#[test]
fn with_no_usage_reported_the_reservation_is_kept() {
    let mut host = Host::new(&config(""));
    let body = chat(50, Some("500"));
    let reserved = input_of(&body) + 500;
    let flow = host.forward_with_body(PATH, &[], &body);
    host.end(&flow);
    assert_eq!(level(&host, pool_id()), 3000 - reserved as i64);
}

#[test]
fn an_error_the_provider_sent_gives_the_reservation_back() {
    let mut host = Host::new(&config(""));
    let body = chat(50, Some("500"));
    let flow = host.forward_with_body(PATH, &[], &body);
    host.respond(&flow, 400, &[], "");
    assert_eq!(level(&host, pool_id()), 3000);
    assert!(!host.flow(&flow).reserves());
}

#[test]
fn a_request_larger_than_the_bucket_is_refused_for_good() {
    let mut host = Host::new(&config(""));
    // 2,000 words of input plus 2,000 of output cannot fit a bucket of 3,000.
    let body = chat(2000, Some("2000"));
    match host.request_with_body(PATH, &[], &body) {
        Decision::Reply(r) => {
            assert_eq!(r.status, 429);
            assert_eq!(header(&r.headers, "x-should-retry"), "false");
            let text = String::from_utf8(r.body).unwrap();
            assert!(text.contains("can never be admitted"), "{text}");
            assert!(text.contains("holds at most 3000"), "{text}");
        }
        Decision::Forward(_) => panic!("a request larger than the bucket went"),
    }
    // Nothing was taken, and the hold state machine does not hold it either.
    host.forward_with_body(PATH, &[], &chat(10, Some("10")));
    let step = host.arrive_with_body(7, PATH, &[], &body);
    assert!(matches!(step, common::Step::Reply(..)));
}

#[test]
fn the_default_output_is_reserved_when_the_request_sets_none() {
    let mut host = Host::new(&config(r#", "default_output_tokens": 700"#));
    let body = chat(10, None);
    let flow = host.forward_with_body(PATH, &[], &body);
    assert_eq!(flow.charges[0].reserved, input_of(&body) + 700);
    // Every dialect's spelling of the output limit.
    for (body, max) in [
        (r#"{"max_completion_tokens": 321}"#, 321),
        (r#"{"max_output_tokens": 322}"#, 322),
        (
            r#"{"contents": [], "generationConfig": {"maxOutputTokens": 323}}"#,
            323,
        ),
        (
            r#"{"model": "claude", "max_tokens": 324, "messages": []}"#,
            324,
        ),
    ] {
        let flow = host.forward_with_body(PATH, &[], body.as_bytes());
        assert_eq!(
            flow.charges[0].reserved,
            input_of(body.as_bytes()) + max,
            "{body}"
        );
    }
}

#[test]
fn bad_bodies_are_estimated_safely_never_refused_for_our_parser() {
    let mut host =
        Host::new(r#"{"limits": [{"name": "tpm", "key": "pool", "tokens_per_minute": 200000}]}"#);
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let gzip: Vec<u8> = [0x1f, 0x8b, 0x08, 0x00]
        .into_iter()
        .chain((0..2000u32).map(|i| (i * 7919 % 251) as u8))
        .collect();
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("not json", b"hello there, this is not json at all".to_vec()),
        ("truncated", chat(100, Some("200"))[..200].to_vec()),
        ("deeply nested", deep.into_bytes()),
        ("gzip", gzip),
        ("negative max_tokens", chat(10, Some("-5"))),
        ("huge max_tokens", chat(10, Some("99999999999999999999999"))),
        ("string max_tokens", chat(10, Some("\"200\""))),
        ("fractional max_tokens", chat(10, Some("2.5"))),
        ("empty", Vec::new()),
    ];
    for (name, body) in bodies {
        let est = estimate::estimate(&body, body.len());
        assert!(
            est.max_output.unwrap_or(0) <= estimate::MAX_OUTPUT,
            "{name}"
        );
        let decision = host.request_with_body(PATH, &[], &body);
        match decision {
            Decision::Forward(f) => {
                // An OpenAI path: counted as OpenAI's limiter does (settle auto).
                assert_eq!(f.charges[0].reserved, est.by_characters(1024), "{name}")
            }
            // Only the huge output limit may not fit: it is capped at MAX_OUTPUT, which no
            // bucket of 200,000 holds, so it is refused as too large, not as unparseable.
            Decision::Reply(r) => {
                assert_eq!(name, "huge max_tokens");
                assert_eq!(header(&r.headers, "x-should-retry"), "false");
            }
        }
        host.advance(60_000);
    }
}

#[test]
fn reserve_false_keeps_charging_after_the_response() {
    let mut host = Host::new(&config(r#", "reserve": false"#));
    let body = chat(100, Some("200"));
    let flow = host.forward_with_body(PATH, &[], &body);
    assert_eq!(flow.charges[0].reserved, 0);
    assert!(host
        .store
        .get(&keys::bucket_key("tpm", pool_id()))
        .unwrap()
        .is_some());
    assert_eq!(level(&host, pool_id()), 3000);
    host.end_with_usage(&flow, 2500);
    assert_eq!(level(&host, pool_id()), 500);
}

#[test]
fn reservations_stay_exact_when_other_workers_write_in_between() {
    // Every bucket write meets a CAS conflict first (another worker wrote the key between our
    // read and our write) and is retried on the fresh value: the bucket ends at exactly the
    // burst minus the usage, reserved and settled in any order.
    let mut host = Host::new(&config(""));
    let body = chat(20, Some("100"));
    let reserved = input_of(&body) + 100;
    let mut flows = Vec::new();
    for _ in 0..10 {
        host.store
            .inject_conflicts
            .store(1, std::sync::atomic::Ordering::SeqCst);
        flows.push(host.forward_with_body(PATH, &[], &body));
    }
    assert_eq!(level(&host, pool_id()), 3000 - 10 * reserved as i64);
    let mut used = 0;
    for (i, flow) in flows.iter().enumerate().rev() {
        host.store
            .inject_conflicts
            .store(2, std::sync::atomic::Ordering::SeqCst);
        let u = 40 + i as u64 * 17;
        used += u;
        host.end_with_usage(flow, u);
    }
    assert_eq!(level(&host, pool_id()), 3000 - used as i64);
}

#[test]
fn model_keys_give_each_model_its_own_bucket_within_max_keys() {
    let cfg = r#"{"limits": [
        {"name": "tpm", "key": "model", "tokens_per_minute": 6000, "burst": 3000},
        {"name": "tenant-model", "key": "header:x-tenant+model", "requests_per_minute": 60, "burst": 1}
    ]}"#;
    let mut host = Host::new(cfg);
    let body = |model: &str| {
        format!(
            r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":10}}"#
        )
        .into_bytes()
    };
    let t1 = [("x-tenant", "t1")];
    let a = host.forward_with_body(PATH, &t1, &body("gpt-4o"));
    let b = host.forward_with_body(PATH, &t1, &body("gpt-4o-mini"));
    assert_ne!(a.limit_keys[0], b.limit_keys[0], "one bucket per model");
    assert_eq!(a.limit_keys[0], host.governor().id(b"gpt-4o"));
    // (tenant, model): t1 spent its one request on each model; t2 has its own.
    assert!(matches!(
        host.request_with_body(PATH, &t1, &body("gpt-4o")),
        Decision::Reply(..)
    ));
    host.forward_with_body(PATH, &[("x-tenant", "t2")], &body("gpt-4o"));
    // Azure names the deployment in its path, Gemini the model: the path wins.
    let azure = host.forward_with_body(
        "/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21",
        &[("x-tenant", "t3")],
        &body("ignored"),
    );
    assert_eq!(azure.limit_keys[0], host.governor().id(b"prod-4o"));
    let gemini = host.forward_with_body(
        "/v1beta/models/gemini-2.0-flash:generateContent",
        &[("x-tenant", "t4")],
        br#"{"contents":[{"parts":[{"text":"hi"}]}]}"#,
    );
    assert_eq!(
        gemini.limit_keys[0],
        host.governor().id(b"gemini-2.0-flash")
    );
}

#[test]
fn unknown_models_share_the_overflow_bucket_past_max_keys() {
    let cfg = r#"{"max_keys": 3, "limits": [
        {"name": "tpm", "key": "model", "tokens_per_minute": 600000}
    ]}"#;
    let mut host = Host::new(cfg);
    let mut overflowed = 0;
    for i in 0..20 {
        let body = format!(r#"{{"model":"m{i}","messages":[],"max_tokens":10}}"#);
        let f = host.forward_with_body(PATH, &[], body.as_bytes());
        overflowed += f.charges.iter().filter(|c| c.key.ends_with(":~")).count();
    }
    assert_eq!(overflowed, 17);
    assert!(host.store.len() <= 3 + 2, "{}", host.store.len());
}

#[test]
fn settle_reservation_counts_as_openai_does_and_is_never_adjusted() {
    let mut host = Host::new(&config(r#", "settle": "reservation""#));
    let body = chat(100, Some("200"));
    // OpenAI's limiter counts from the character count: the body's bytes / 4, when more.
    let counted = (input_of(&body)).max((body.len() as u64).div_ceil(4)) + 200;
    assert!(
        counted > input_of(&body) + 200,
        "prose JSON has more bytes / 4 than tokens"
    );
    let flow = host.forward_with_body(PATH, &[], &body);
    assert_eq!(flow.charges[0].reserved, counted);
    host.end_with_usage(&flow, 10);
    assert_eq!(level(&host, pool_id()), 3000 - counted as i64);
    // An error the provider answered still gives it back: its limiter counted nothing.
    let flow = host.forward_with_body(PATH, &[], &body);
    host.respond(&flow, 400, &[], "");
    assert_eq!(level(&host, pool_id()), 3000 - counted as i64);
}

#[test]
fn auto_settles_as_the_provider_behind_the_request_counts() {
    let mut host = Host::new(&config(r#", "settle": "auto""#));
    let body = chat(100, Some("200"));
    let by_chars = input_of(&body).max((body.len() as u64).div_ceil(4)) + 200;
    // OpenAI (and Azure OpenAI) count at admission and never adjust.
    let openai = host.forward_with_body(PATH, &[], &body);
    assert_eq!(openai.charges[0].reserved, by_chars);
    host.end_with_usage(&openai, 10);
    assert_eq!(level(&host, pool_id()), 3000 - by_chars as i64);
    // Anthropic adjusts to the tokens used at the end of a request.
    let anthropic = [("anthropic-version", "2023-06-01")];
    let flow = host.forward_with_body("/v1/messages", &anthropic, &body);
    assert_eq!(flow.charges[0].reserved, input_of(&body) + 200);
    host.end_with_usage(&flow, 10);
    assert_eq!(level(&host, pool_id()), 3000 - by_chars as i64 - 10);
}

#[test]
fn a_provider_reporting_its_tokens_empty_cools_for_one_reservation_not_its_full_reset() {
    let mut host = Host::new(&config(""));
    let body = chat(100, Some("900"));
    let flow = host.forward_with_body(PATH, &[], &body);
    let reserved = flow.charges[0].reserved;
    // OpenAI: 20,000 TPM left empty by this request, full again in 60 s.
    host.respond(
        &flow,
        200,
        &[
            ("x-ratelimit-limit-tokens", "20000"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "60s"),
        ],
        "",
    );
    match host.request_with_body(PATH, &[], &body) {
        Decision::Reply(r) => {
            assert_eq!(header(&r.headers, "x-llm-governor-source"), "cooldown");
            // A request like it fits once reserved × 60 s / 20,000 has refilled (and the grain).
            let want = 60_000 * reserved / 20_000 + GRAIN;
            assert_eq!(header(&r.headers, "retry-after-ms"), want.to_string());
        }
        Decision::Forward(_) => panic!("the provider said it had no tokens left"),
    }
}
