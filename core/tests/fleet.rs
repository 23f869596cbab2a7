//! Fleet limits through the worker: what is asked of the rate-limit service, what each answer
//! (or its absence) makes of the request, and what a stream owes the service at its end.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::reactions::{calls, replied};
use common::*;
use llm_governor_core::effects::TICK_MS;
use llm_governor_core::fleet::ask::ANSWER_SLACK_MS;
use llm_governor_core::fleet::grpc::{Method, ServiceCall, ServiceReply};
use llm_governor_core::metrics::{Counter, Histogram};
use llm_governor_core::worker::{Action, Effect, Reaction, Stage};

const RPM: &str = r#"{"fleet": {"cluster": "rls", "timeout_ms": 50},
  "limits": [{"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 2, "scope": "fleet"}],
  "hold": {"max_ms": 0}}"#;

fn with_on_error(on_error: &str) -> String {
    RPM.replace(
        r#""timeout_ms": 50"#,
        &format!(r#""timeout_ms": 50, "on_error": "{on_error}""#),
    )
}

const TENANT: &[(&str, &str)] = &[("x-tenant-id", "acme"), ("x-api-key", "sk-secret-of-acme")];

/// The service says OK to call `seq` of stream `id`, the last it waited for: the request goes.
fn let_go_by(h: &mut Host, id: u32, seq: u32) {
    let r = h.service_answer(id, seq, ServiceReply::Message(&rls_answer(1, None)));
    assert!(r.effects.contains(&Effect::ResumeRequest), "{r:?}");
}

fn reply_header<'a>(r: &'a Reaction, name: &str) -> &'a str {
    let reply = replied(r).unwrap_or_else(|| panic!("no local answer: {r:?}"));
    header(&reply.headers, name)
}

#[test]
fn a_fleet_limit_asks_the_service_with_the_contract_descriptor_and_goes_on_its_ok() {
    let mut h = Host::new(RPM);
    let r = h.request_headers(7, TENANT, true);
    assert_eq!(r.action, Action::Pause);
    let asked = calls(&r);
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].method, Method::ShouldRateLimit);
    assert_eq!(asked[0].timeout_ms, 50);
    let m = &asked[0].message;
    assert!(contains(m, b"llm_governor"), "domain");
    assert!(
        contains(m, b"limit")
            && contains(m, b"tenant-rpm")
            && contains(m, b"key")
            && contains(m, b"acme")
    );
    assert!(
        !contains(m, b"sk-secret"),
        "a credential never reaches the service"
    );
    assert_eq!(h.worker.stage(7), Stage::AwaitingFleet);

    let_go_by(&mut h, 7, asked[0].seq);
    assert_eq!(h.worker.stage(7), Stage::Upstream);
    assert_eq!(h.count(Counter::FleetCallsOk), 1);
    assert_eq!(h.metrics.fleet_call_ms.len(), 1);
    let _ = Histogram::FleetCallMs;
}

#[test]
fn an_over_limit_answer_is_a_local_429_told_the_services_wait() {
    let mut h = Host::new(RPM);
    let r = h.request_headers(7, TENANT, true);
    let seq = calls(&r)[0].seq;
    let r = h.service_answer(7, seq, ServiceReply::Message(&rls_answer(2, Some(7))));
    let reply = replied(&r).expect("answered locally");
    assert_eq!(reply.status, 429);
    assert_eq!(reply_header(&r, "x-llm-governor-source"), "limit");
    assert_eq!(reply_header(&r, "x-llm-governor-class"), "rate_limited");
    let told: u64 = reply_header(&r, "retry-after-ms").parse().unwrap();
    assert!((7000..=7000 * 12 / 10).contains(&told), "{told}");
    assert!(reply_header(&r, "ratelimit-policy").contains("\"tenant-rpm\";q=2;w=60"));
    assert_eq!(h.count(Counter::FleetCallsOverLimit), 1);
    assert_eq!(h.worker.stage(7), Stage::Done);
}

#[test]
fn what_local_limits_took_goes_back_when_the_fleet_refuses() {
    let cfg = RPM.replace(
        r#""scope": "fleet"}]"#,
        r#""scope": "fleet"}, {"name": "local", "key": "header:x-tenant-id", "requests_per_minute": 1}]"#,
    );
    let mut h = Host::new(&cfg);
    let r = h.request_headers(1, TENANT, true);
    let seq = calls(&r)[0].seq;
    replied(&h.service_answer(1, seq, ServiceReply::Message(&rls_answer(2, Some(1)))))
        .expect("refused");
    // The local bucket of one got its request back: the next one is admitted locally again.
    let r = h.request_headers(2, TENANT, true);
    assert_eq!(
        calls(&r).len(),
        1,
        "admitted locally, asked the fleet: {r:?}"
    );
}

#[test]
fn a_failed_call_falls_back_to_this_envoys_own_bucket_of_the_same_rate() {
    let mut h = Host::new(RPM); // on_error defaults to local
    let mut outcomes = Vec::new();
    for id in 1..=3 {
        let r = h.request_headers(id, TENANT, true);
        let seq = calls(&r)[0].seq;
        let r = h.service_answer(id, seq, ServiceReply::Failed(14));
        outcomes.push(if replied(&r).is_some() { "429" } else { "go" });
    }
    assert_eq!(outcomes, ["go", "go", "429"]);
    assert_eq!(h.count(Counter::FleetErrors), 3);
    assert_eq!(h.count(Counter::FleetFallback), 3);
}

#[test]
fn on_error_allow_lets_it_go_and_deny_answers_it() {
    let mut h = Host::new(&with_on_error("allow"));
    let r = h.request_headers(1, TENANT, true);
    let seq = calls(&r)[0].seq;
    assert!(h
        .service_answer(1, seq, ServiceReply::Failed(4))
        .effects
        .contains(&Effect::ResumeRequest));

    let mut h = Host::new(&with_on_error("deny"));
    let r = h.request_headers(1, TENANT, true);
    let seq = calls(&r)[0].seq;
    let r = h.service_answer(1, seq, ServiceReply::Failed(4));
    assert_eq!(replied(&r).map(|x| x.status), Some(429));
    assert_eq!(h.count(Counter::FleetFallback), 1);
}

#[test]
fn garbage_or_an_unknown_code_is_a_failure_never_a_panic() {
    for bytes in [
        &[0xff, 0xff, 0xff][..],
        &[0x08, 0x07][..],
        &[0x12, 0x40, 0x01][..],
        &[][..],
    ] {
        let mut h = Host::new(&with_on_error("deny"));
        let r = h.request_headers(1, TENANT, true);
        let seq = calls(&r)[0].seq;
        let r = h.service_answer(1, seq, ServiceReply::Message(bytes));
        assert!(replied(&r).is_some(), "{bytes:?}: {r:?}");
        assert_eq!(h.count(Counter::FleetErrors), 1);
    }
}

#[test]
fn no_answer_by_the_timeout_is_a_failure_decided_on_the_tick() {
    let mut h = Host::new(&with_on_error("allow"));
    h.request_headers(1, TENANT, true);
    h.advance(99);
    assert!(
        h.tick_reactions().is_empty(),
        "not overdue before timeout + slack"
    );
    h.advance(2);
    let left = h.tick_reactions();
    assert_eq!(left.len(), 1);
    assert!(
        left[0].1.effects.contains(&Effect::ResumeRequest),
        "{left:?}"
    );
    assert_eq!(h.count(Counter::FleetErrors), 1);
    // The answer that comes afterwards is ignored.
    let late = h.service_answer(1, 1, ServiceReply::Message(&rls_answer(2, None)));
    assert!(late.effects.is_empty());
    assert_eq!(h.worker.stage(1), Stage::Upstream);
}

#[test]
fn a_call_that_could_not_be_sent_is_a_failed_call() {
    let mut h = Host::new(&with_on_error("deny"));
    let r = h.request_headers(1, TENANT, true);
    let seq = calls(&r)[0].seq;
    let failure = Effect::CallService(calls(&r)[0].clone())
        .failure()
        .expect("reported");
    let r = h.call(|w, lent| w.failed(1, failure, lent));
    assert_eq!(replied(&r).map(|x| x.status), Some(429));
    assert_eq!(seq, calls(&h.request_headers(2, TENANT, true))[0].seq - 1);
}

/// Stream 1, held after the service refused it with a reset of `reset_s`, the worker drawing
/// `u`.
fn held_by_a_refusal(reset_s: u64, u: f64) -> Host {
    let cfg = RPM.replace(r#""hold": {"max_ms": 0}"#, r#""hold": {"max_ms": 10000}"#);
    let mut h = Host::new(&cfg);
    h.rng.set(u);
    let hs = [TENANT, &[("x-stainless-timeout", "30")][..]].concat();
    let r = h.request_headers(1, &hs, true);
    let seq = calls(&r)[0].seq;
    let r = h.service_answer(1, seq, ServiceReply::Message(&rls_answer(2, Some(reset_s))));
    assert!(replied(&r).is_none() && r.action == Action::Pause, "{r:?}");
    assert_eq!(h.worker.stage(1), Stage::Held);
    h
}

#[test]
fn a_refusal_whose_wait_fits_is_held_and_asks_again_when_it_ends() {
    let mut h = held_by_a_refusal(2, 0.0);
    h.advance(1999);
    assert!(h.tick_reactions().is_empty());
    h.advance(1);
    let left = h.tick_reactions();
    let again = calls(&left[0].1);
    assert_eq!(again.len(), 1, "released to ask the fleet again: {left:?}");
    let_go_by(&mut h, 1, again[0].seq);
}

/// Held after a refusal of `reset_s` with the worker drawing `u`: the ms until it asks again.
fn asks_again_after(reset_s: u64, u: f64) -> u64 {
    let mut h = held_by_a_refusal(reset_s, u);
    for waited in 1..=60_000 {
        h.advance(1);
        let left = h.tick_reactions();
        if !left.is_empty() {
            assert_eq!(
                calls(&left[0].1).len(),
                1,
                "released to ask the fleet again: {left:?}"
            );
            return waited;
        }
    }
    panic!("never asked again");
}

#[test]
fn a_refusal_with_no_wait_left_asks_again_after_a_jittered_reask_period() {
    // Limitador's reset in whole seconds rounded down: 0 in a window's last second. Not at
    // once (the native host has no tick to round 1 ms up), and spread over [1, 2 × REASK_MS) so
    // requests refused together do not ask together.
    assert_eq!(asks_again_after(0, 0.0), 1);
    assert_eq!(asks_again_after(0, 0.5), 1 + 39 / 2);
    assert_eq!(asks_again_after(0, 0.999_999), 2 * TICK_MS - 1);
    // A reported wait is kept as it is.
    assert_eq!(asks_again_after(2, 0.999_999), 2000);
}

const TPM: &str = r#"{"fleet": {"cluster": "rls", "timeout_ms": 50},
  "pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}],
  "limits": [{"name": "tpm", "key": "header:x-tenant-id", "tokens_per_minute": 100000, "scope": "fleet",
              "settle": "usage"}],
  "hold": {"max_ms": 0}}"#;

const BODY: &str =
    r#"{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"hello"}]}"#;
const USAGE: &str =
    r#"{"id":"x","usage":{"prompt_tokens":9,"completion_tokens":21,"total_tokens":30}}"#;

/// A request with a body through the worker: headers, then the whole body. The reaction.
fn with_body(h: &mut Host, id: u32) -> Reaction {
    let r = h.request_headers(id, TENANT, false);
    assert_eq!(r.action, Action::Pause);
    h.io.request_bodies.insert(id, BODY.as_bytes().to_vec());
    h.call(|w, lent| w.on_request_body(id, BODY.len(), true, lent))
}

#[test]
fn a_token_budget_reserves_its_estimate_and_commits_what_was_used() {
    let mut h = Host::new(TPM);
    let r = with_body(&mut h, 3);
    let asked = calls(&r);
    assert_eq!(asked[0].method, Method::Reserve);
    let r = h.service_answer(
        3,
        asked[0].seq,
        ServiceReply::Message(&reserve_answer(1, "res-42")),
    );
    assert!(r.effects.contains(&Effect::ResumeRequest));
    h.response(3, 200, &[("content-type", "application/json")], USAGE);
    h.end(3);
    let owed = h.worker.calls().take_owed();
    assert_eq!(owed.len(), 1);
    assert_eq!(owed[0].method, Method::Commit);
    assert!(contains(&owed[0].message, b"res-42"));
    // actual_amount = 4: the usage reported (30 tokens), as a varint.
    assert!(
        owed[0].message.ends_with(&[0x20, 30]),
        "{:?}",
        owed[0].message
    );
    assert!(h.worker.tick_ms().is_some() || h.worker.calls().take_owed().is_empty());
}

#[test]
fn a_provider_error_commits_nothing_used() {
    let mut h = Host::new(TPM);
    let r = with_body(&mut h, 3);
    let seq = calls(&r)[0].seq;
    h.service_answer(3, seq, ServiceReply::Message(&reserve_answer(1, "res-1")));
    h.response(3, 500, &[], r#"{"error":{"message":"boom"}}"#);
    h.end(3);
    let owed = h.worker.calls().take_owed();
    assert!(
        owed[0].message.ends_with(&[0x20, 0]),
        "{:?}",
        owed[0].message
    );
}

#[test]
fn without_reservations_a_budget_is_charged_then_topped_up_never_refunded() {
    let cfg = TPM.replace(
        r#""timeout_ms": 50"#,
        r#""timeout_ms": 50, "reservations": false"#,
    );
    let mut h = Host::new(&cfg);
    let r = with_body(&mut h, 3);
    let asked = calls(&r);
    assert_eq!(asked[0].method, Method::ShouldRateLimit);
    let_go_by(&mut h, 3, asked[0].seq);
    // It reserved more than the 30 it used: nothing is sent back (no refund).
    h.response(3, 200, &[], USAGE);
    h.end(3);
    assert!(h.worker.calls().take_owed().is_empty());

    // Used more than charged: the difference is a positive charge.
    let big = USAGE
        .replace("\"total_tokens\":30", "\"total_tokens\":5000")
        .replace("21", "4991");
    let r = with_body(&mut h, 4);
    let asked = calls(&r);
    let_go_by(&mut h, 4, asked[0].seq);
    h.response(4, 200, &[], &big);
    h.end(4);
    let owed = h.worker.calls().take_owed();
    assert_eq!(owed.len(), 1);
    assert_eq!(owed[0].method, Method::ShouldRateLimit);
}

/// A token budget and a request limit, both the fleet's: what a request with a body (stream
/// 3) asks first.
fn token_and_request_limits_asked() -> (Host, Vec<ServiceCall>) {
    let cfg = TPM.replace(
        r#""settle": "usage"}]"#,
        r#""settle": "usage"}, {"name": "rpm", "key": "header:x-tenant-id", "requests_per_minute": 1, "scope": "fleet"}]"#,
    );
    let mut h = Host::new(&cfg);
    let r = with_body(&mut h, 3);
    (h, calls(&r))
}

#[test]
fn the_request_limit_is_asked_only_once_the_token_budget_reserved() {
    // A hit ShouldRateLimit counted is never given back; a reservation is (a Commit of 0).
    let (mut h, asked) = token_and_request_limits_asked();
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert_eq!(
        asked[0].method,
        Method::Reserve,
        "token budgets are asked first"
    );
    let r = h.service_answer(
        3,
        asked[0].seq,
        ServiceReply::Message(&reserve_answer(1, "res-1")),
    );
    let then = calls(&r);
    assert_eq!(then.len(), 1);
    assert_eq!(then[0].method, Method::ShouldRateLimit);
    assert!(contains(&then[0].message, b"rpm"));
    assert_eq!(h.worker.stage(3), Stage::AwaitingFleet);
    let_go_by(&mut h, 3, then[0].seq);
    assert!(h.worker.calls().take_owed().is_empty());
}

#[test]
fn a_token_budget_s_refusal_charges_the_request_limit_nothing() {
    let (mut h, asked) = token_and_request_limits_asked();
    let r = h.service_answer(
        3,
        asked[0].seq,
        ServiceReply::Message(&rls_answer(2, Some(4))),
    );
    assert!(
        calls(&r).is_empty(),
        "no ShouldRateLimit after a refusal: {r:?}"
    );
    assert_eq!(replied(&r).map(|x| x.status), Some(429));
    assert!(
        h.worker.calls().take_owed().is_empty(),
        "nothing was granted, nothing to release"
    );
}

#[test]
fn a_failed_reservation_still_asks_the_request_limit_and_falls_back_for_the_budget() {
    let (mut h, asked) = token_and_request_limits_asked();
    let r = h.service_answer(3, asked[0].seq, ServiceReply::Failed(14));
    let then = calls(&r);
    assert_eq!(then.len(), 1);
    assert_eq!(then[0].method, Method::ShouldRateLimit);
    let_go_by(&mut h, 3, then[0].seq);
    assert_eq!(h.count(Counter::FleetFallback), 1);
    assert_eq!(h.count(Counter::FleetErrors), 1);
}

#[test]
fn a_first_stage_with_no_answer_by_the_timeout_asks_nothing_more() {
    let (mut h, _asked) = token_and_request_limits_asked();
    h.advance(50 + ANSWER_SLACK_MS);
    let left = h.tick_reactions();
    assert_eq!(left.len(), 1);
    assert!(calls(&left[0].1).is_empty(), "{left:?}");
    // One call was sent and failed; the request limit never asked falls back too.
    assert_eq!(h.count(Counter::FleetErrors), 1);
    assert_eq!(h.count(Counter::FleetFallback), 1);
}

#[test]
fn a_stream_gone_while_waiting_releases_its_reservation_and_local_takes() {
    let (mut h, asked) = token_and_request_limits_asked();
    h.service_answer(
        3,
        asked[0].seq,
        ServiceReply::Message(&reserve_answer(1, "res-9")),
    );
    h.end(3);
    let owed = h.worker.calls().take_owed();
    assert_eq!(owed.len(), 1);
    assert!(contains(&owed[0].message, b"res-9") && owed[0].message.ends_with(&[0x20, 0]));
}

#[test]
fn a_refusal_by_one_limit_releases_the_reservation_another_granted() {
    let (mut h, asked) = token_and_request_limits_asked();
    let r = h.service_answer(
        3,
        asked[0].seq,
        ServiceReply::Message(&reserve_answer(1, "res-5")),
    );
    let r = h.service_answer(
        3,
        calls(&r)[0].seq,
        ServiceReply::Message(&rls_answer(2, Some(3))),
    );
    assert_eq!(replied(&r).map(|x| x.status), Some(429));
    let owed = h.worker.calls().take_owed();
    assert!(contains(&owed[0].message, b"res-5") && owed[0].message.ends_with(&[0x20, 0]));
}

#[test]
fn an_account_key_goes_to_the_service_as_its_label_or_keyed_id() {
    let cfg = r#"{"fleet": {"cluster": "rls"},
      "pools": [{"name": "shared", "match": {"path_prefix": "/v1/shared"}, "account": "team-a"}],
      "limits": [{"name": "acct", "key": "account", "requests_per_minute": 5, "scope": "fleet"},
                 {"name": "byhdr", "key": "header:authorization", "requests_per_minute": 5, "scope": "fleet"}]}"#;
    let mut h = Host::new(cfg);
    let r = h.request_headers(1, &[("authorization", "Bearer sk-very-secret")], true);
    for c in calls(&r) {
        assert!(
            !contains(&c.message, b"sk-very-secret"),
            "credential leaked: {:?}",
            c.message
        );
    }
    let owned: Vec<(String, Vec<u8>)> = vec![("authorization".into(), b"Bearer sk-x".to_vec())];
    let v = view("/v1/shared/x", &owned);
    let r = h.call(|w, lent| w.on_request_headers(2, &v, true, lent));
    assert!(
        contains(&calls(&r)[0].message, b"team-a"),
        "the pool's label"
    );
}

// ---- gRPC over an HTTP callout (the native module's way to the service) ----

use llm_governor_core::fleet::grpc;

#[test]
fn a_call_is_a_grpc_post_on_the_method_s_path_with_one_uncompressed_frame() {
    let h = grpc::request_headers(&grpc::path(Method::Reserve), "limitador");
    assert_eq!(h[0], (":method", "POST".to_string()));
    assert_eq!(
        h[1],
        (
            ":path",
            "/kuadrant.service.ratelimit.v1.RateLimitService/Reserve".to_string()
        )
    );
    assert!(h.contains(&("host", "limitador".to_string())));
    assert!(h.contains(&("content-type", "application/grpc".to_string())));
    assert_eq!(grpc::frame(b"abc"), vec![0, 0, 0, 0, 3, b'a', b'b', b'c']);
    assert_eq!(grpc::frame(b""), vec![0, 0, 0, 0, 0]);
}

#[test]
fn an_answer_is_its_message_or_the_status_that_says_why_not() {
    let ok = Some(b"200".as_slice());
    let framed = grpc::frame(b"hello");
    // A message after the headers (grpc-status 0 came in the trailers, which are not handed on).
    assert_eq!(
        grpc::reply(ok, None, &framed),
        ServiceReply::Message(b"hello")
    );
    assert_eq!(
        grpc::reply(ok, Some(b"0"), &framed),
        ServiceReply::Message(b"hello")
    );
    // Trailers-only errors: the status is in the headers.
    assert_eq!(grpc::reply(ok, Some(b"14"), &[]), ServiceReply::Failed(14));
    assert_eq!(
        grpc::reply(ok, Some(b"4"), &framed),
        ServiceReply::Failed(4)
    );
    assert_eq!(
        grpc::reply(ok, Some(b"x"), &framed),
        ServiceReply::Failed(2)
    );
    // Not gRPC's answer at all: the HTTP status, mapped as gRPC maps it.
    assert_eq!(
        grpc::reply(Some(b"503"), None, &framed),
        ServiceReply::Failed(14)
    );
    assert_eq!(
        grpc::reply(Some(b"404"), None, &[]),
        ServiceReply::Failed(12)
    );
    assert_eq!(grpc::reply(None, None, &framed), ServiceReply::Failed(2));
    // No message, a truncated one, a compressed one.
    assert_eq!(grpc::reply(ok, None, &[]), ServiceReply::Failed(2));
    assert_eq!(
        grpc::reply(ok, None, &framed[..7]),
        ServiceReply::Failed(13)
    );
    assert_eq!(grpc::reply(ok, None, &[0, 0, 0]), ServiceReply::Failed(13));
    let mut compressed = framed.clone();
    compressed[0] = 1;
    assert_eq!(grpc::reply(ok, None, &compressed), ServiceReply::Failed(13));
    // A length beyond the body, and bytes after the frame (ignored: one message per call).
    assert_eq!(
        grpc::reply(ok, None, &[0, 255, 255, 255, 255, 1]),
        ServiceReply::Failed(13)
    );
    let mut extra = framed.clone();
    extra.extend_from_slice(b"junk");
    assert_eq!(
        grpc::reply(ok, None, &extra),
        ServiceReply::Message(b"hello")
    );
}
