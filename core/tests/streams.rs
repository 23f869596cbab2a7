//! A stream's lifecycle in the `Worker`, callback by callback, as a host drives it: the waits
//! for bodies and their deadlines, what an overdue wait does, the headers-only mode after a body
//! never came, local answers that wait for the end of the request body, refunds on provider
//! errors, and Envoy's own 503 left ungoverned.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::provider::{A, QUOTA};
use common::reactions::{paused, replies, set_headers};
use common::{cool, header, Host};
use llm_governor_core::effects::Direction;
use llm_governor_core::headers::owned;
use llm_governor_core::metrics::Counter;
use llm_governor_core::worker::{
    Action, Effect, Failure, Reaction, Stage, BODY_WAIT_MS, HEADERS_ONLY_FOR_MS,
    REQUEST_BODY_WAIT_MS,
};

/// A token limit that reserves: request bodies are read before admission.
const RESERVING: &str = r#"{"limits": [{"name": "tpm", "key": "pool", "tokens_per_minute": 60000, "burst": 30000, "reserve": true}]}"#;
const BODY: &[u8] =
    br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello there"}],"max_tokens":50}"#;

/// A part of stream `id`'s request body: `buffered` bytes in all so far.
fn body(host: &mut Host, id: u32, buffered: usize, eos: bool) -> Reaction {
    host.call(|w, lent| w.on_request_body(id, buffered, eos, lent))
}

#[test]
fn a_reserving_request_waits_for_its_body_and_is_admitted_on_it() {
    let mut host = Host::new(RESERVING);
    assert_eq!(host.request_headers(1, &[A], false), paused(vec![]));
    assert_eq!(host.worker.stage(1), Stage::ReadingBody);
    host.io.request_bodies.insert(1, BODY.to_vec());
    assert_eq!(
        body(&mut host, 1, 10, false),
        paused(vec![]),
        "Envoy buffers the rest"
    );
    let r = body(&mut host, 1, BODY.len(), true);
    assert_eq!(r.action, Action::Continue);
    let flow = host.worker.flow(1).unwrap();
    assert!(flow.estimate.is_some(), "estimated from the body");
    assert!(flow.reserves());
    assert_eq!(host.worker.tick_ms(), None, "nothing left to wait for");
}

#[test]
fn a_body_that_never_comes_is_admitted_unread_and_turns_on_headers_only_mode_for_a_minute() {
    let mut host = Host::new(RESERVING);
    host.request_headers(1, &[A], false);
    assert_eq!(host.worker.next_due_ms(), Some(host.now_ms + BODY_WAIT_MS));
    host.advance(BODY_WAIT_MS - 1);
    assert!(host.tick_reactions().is_empty());
    host.advance(1);
    assert_eq!(
        host.tick_reactions(),
        [(1, paused(vec![Effect::ResumeRequest]))]
    );
    assert_eq!(host.worker.stage(1), Stage::Upstream);
    assert_eq!(host.metrics.count_of(0, Counter::BodyUnavailable), 1);
    // For a minute, requests are admitted at their headers: nothing pauses for a body.
    assert_eq!(
        host.request_headers(2, &[A], false).action,
        Action::Continue
    );
    host.advance(HEADERS_ONLY_FOR_MS);
    assert_eq!(host.request_headers(3, &[A], false), paused(vec![]));
    assert_eq!(
        host.worker.stage(3),
        Stage::ReadingBody,
        "then it tries again"
    );
}

#[test]
fn a_slow_body_gets_the_longer_wait_once_its_first_part_arrives() {
    let mut host = Host::new(RESERVING);
    host.request_headers(1, &[A], false);
    host.advance(500);
    host.io.request_bodies.insert(1, BODY[..20].to_vec());
    body(&mut host, 1, 20, false);
    assert_eq!(
        host.worker.next_due_ms(),
        Some(host.now_ms + REQUEST_BODY_WAIT_MS)
    );
    host.advance(REQUEST_BODY_WAIT_MS - 1);
    assert!(host.tick_reactions().is_empty(), "still within its wait");
    host.advance(1);
    let out = host.tick_reactions();
    assert_eq!(out, [(1, paused(vec![Effect::ResumeRequest]))]);
    assert!(
        host.worker.flow(1).unwrap().estimate.is_some(),
        "on what arrived"
    );
    assert_eq!(
        host.metrics.count_of(0, Counter::BodyUnavailable),
        0,
        "a slow body is no sign that body callbacks are missing"
    );
}

#[test]
fn a_local_answer_waits_for_the_end_of_the_request_body_and_drops_what_arrives() {
    let mut host = Host::new("{}");
    cool(&mut host, "30");
    let r = host.request_headers(1, &[A, ("x-envoy-expected-rq-timeout-ms", "0")], false);
    assert_eq!(r.action, Action::Pause);
    assert!(replies(&r).is_empty(), "not before the body has ended");
    assert!(matches!(r.effects[..], [Effect::AccessLog(_)]));
    assert_eq!(host.worker.stage(1), Stage::ReplyPending);
    assert_eq!(
        body(&mut host, 1, 4096, false),
        paused(vec![Effect::DropRequestBody(4096)])
    );
    let r = body(&mut host, 1, 100, true);
    assert_eq!(replies(&r), [429]);
    assert_eq!(host.worker.stage(1), Stage::Done);
}

#[test]
fn a_local_answer_whose_request_body_never_ends_is_sent_when_its_wait_is_over() {
    let mut host = Host::new("{}");
    cool(&mut host, "30");
    host.request_headers(1, &[A, ("x-envoy-expected-rq-timeout-ms", "0")], false);
    host.advance(REQUEST_BODY_WAIT_MS - 1);
    assert!(host.tick_reactions().is_empty());
    host.advance(1);
    let out = host.tick_reactions();
    assert_eq!(out.len(), 1);
    assert_eq!(replies(&out[0].1), [429]);
    assert_eq!(host.worker.tick_ms(), None);
}

#[test]
fn in_headers_only_mode_a_local_answer_is_sent_at_once() {
    let mut host = Host::new(RESERVING);
    host.request_headers(1, &[A], false);
    host.advance(BODY_WAIT_MS);
    host.tick_reactions(); // the body never came
    cool(&mut host, "30");
    let r = host.request_headers(2, &[A, ("x-envoy-expected-rq-timeout-ms", "0")], false);
    assert_eq!(replies(&r), [429], "no body callback is coming to wait for");
}

#[test]
fn an_error_response_waits_for_its_body_and_is_classified_by_it() {
    let mut host = Host::new("{}");
    assert_eq!(host.request_headers(1, &[A], true).action, Action::Continue);
    let r = error_headers(&mut host, 1);
    assert_eq!(r, paused(vec![]));
    assert_eq!(host.worker.stage(1), Stage::AwaitingErrorBody);
    host.io.response_bodies.insert(1, QUOTA.as_bytes().to_vec());
    let part = host.call(|w, lent| w.on_response_body(1, 10, false, lent));
    assert_eq!(part, paused(vec![]), "until the body ends");
    let r = host.call(|w, lent| w.on_response_body(1, QUOTA.len(), true, lent));
    assert_eq!(r.action, Action::Continue);
    assert_eq!(
        header(&set_headers(&r), "x-llm-governor-class"),
        "quota_exhausted"
    );
    assert!(matches!(r.effects[0], Effect::AccessLog(_)));
    assert_eq!(host.metrics.count_of(0, Counter::UpstreamQuotaExhausted), 1);
}

#[test]
fn an_error_body_that_never_comes_is_classified_from_status_and_headers() {
    let mut host = Host::new("{}");
    host.request_headers(1, &[A], true);
    let rs = host.response(1, 429, &[("retry-after", "2")], "");
    // An end-of-stream 429 has no body to wait for: classified at once.
    assert_eq!(
        header(&set_headers(&rs[0]), "x-llm-governor-class"),
        "rate_limited"
    );
    host.request_headers(2, &[("authorization", "Bearer sk-b")], true);
    let r = error_headers(&mut host, 2);
    assert_eq!(r.action, Action::Pause);
    host.advance(BODY_WAIT_MS);
    let out = host.tick_reactions();
    assert_eq!(out.len(), 1);
    let (id, r) = &out[0];
    assert_eq!(*id, 2);
    assert_eq!(
        header(&set_headers(r), "x-llm-governor-class"),
        "rate_limited"
    );
    assert_eq!(r.effects.last(), Some(&Effect::ResumeResponse));
    assert_eq!(host.metrics.count_of(0, Counter::BodyUnavailable), 1);
}

#[test]
fn a_provider_error_gives_the_reservation_back_and_envoys_own_503_is_left_ungoverned() {
    // Room for one reservation of BODY (~60 tokens) at a time, refilling 1 token a second.
    let mut host = Host::new(
        r#"{"limits": [{"name": "tpm", "key": "pool", "tokens_per_minute": 60, "burst": 100, "reserve": true}]}"#,
    );
    let reserve = |host: &mut Host, id: u32| {
        host.request_headers(id, &[A], false);
        host.io.request_bodies.insert(id, BODY.to_vec());
        body(host, id, BODY.len(), true);
        host.worker.flow(id).unwrap().charges.clone()
    };
    let before = reserve(&mut host, 1);
    assert!(!before.is_empty());
    // The provider's own 500: its reservation is given back.
    host.response(1, 500, &[], "");
    host.end(1);
    let again = reserve(&mut host, 2);
    assert_eq!(
        again, before,
        "the same reservation fits again: the first was given back"
    );
    // Envoy's own 503 (an upstream reset): not governed, nothing cools.
    host.io.from_envoy.insert(2);
    let rs = host.response(2, 503, &[], "");
    assert_eq!(rs[0].action, Action::Continue);
    assert!(
        set_headers(&rs[0]).is_empty(),
        "Envoy's answer passes untouched"
    );
    assert_eq!(host.metrics.count_of(0, Counter::UpstreamOverloaded), 0);
    // The provider's own 503 is (Envoy's kept stream 2's reservation: stream 3 waits for it).
    host.end(2);
    host.advance(60_000);
    reserve(&mut host, 3);
    let rs = host.response(3, 503, &[], "");
    assert_eq!(
        header(&set_headers(&rs[0]), "x-llm-governor-class"),
        "overloaded"
    );
}

#[test]
fn a_request_whose_wait_outgrows_its_hold_is_answered_once_its_body_ends() {
    let mut host = Host::new(r#"{"hold": {"max_ms": 2000}}"#);
    cool(&mut host, "5");
    // The 5 s wait is longer than the 2 s it may be held: answered, once its body has ended.
    let r = host.request_headers(1, &[A], false);
    assert!(replies(&r).is_empty());
    assert_eq!(host.worker.stage(1), Stage::ReplyPending);
    let r = body(&mut host, 1, 10, true);
    assert_eq!(replies(&r), [429]);
}

const CAP: &str = r#"{"limits": [{"name": "cap", "key": "pool", "max_in_flight": 1}]}"#;

#[test]
fn a_held_request_whose_body_ended_is_answered_at_once_when_its_hold_gives_up() {
    let mut host = Host::new(CAP);
    host.request_headers(1, &[A], true);
    // Its client gives up in 3 s: held for 1 s (the 2 s margin before that).
    let deadline = [A, ("x-envoy-expected-rq-timeout-ms", "3000")];
    assert_eq!(host.request_headers(2, &deadline, false), paused(vec![]));
    assert_eq!(host.worker.stage(2), Stage::Held);
    assert_eq!(
        body(&mut host, 2, 10, true),
        paused(vec![]),
        "held with its body"
    );
    host.advance(999);
    assert!(host.tick_reactions().is_empty());
    host.advance(1);
    let out = host.tick_reactions();
    assert_eq!(out.len(), 1);
    assert_eq!(replies(&out[0].1), [429], "its body ended: answered now");
}

#[test]
fn a_held_request_that_goes_is_steered_then_resumed() {
    let cfg = r#"{"pools": [
      {"name": "primary", "match": {"path_prefix": "/v1/chat"}, "fallback": ["backup"]},
      {"name": "backup", "match": {"header": {"name": "x-never", "value": "x"}}, "account": "b"}
    ], "limits": [{"name": "cap", "key": "pool", "max_in_flight": 1}]}"#;
    let mut host = Host::new(cfg);
    assert_eq!(host.request_headers(1, &[A], true).action, Action::Continue);
    let r = host.request_headers(2, &[A], true);
    assert_eq!(
        r.effects,
        [Effect::Steer("backup".into())],
        "the primary's cap is full"
    );
    assert_eq!(r.action, Action::Continue);
    assert_eq!(host.request_headers(3, &[A], true), paused(vec![]));
    assert_eq!(host.worker.stage(3), Stage::Held, "both caps full: held");
    host.end(2); // the backup's slot frees
    let out = host.tick_reactions();
    assert_eq!(
        out,
        [(
            3,
            paused(vec![Effect::Steer("backup".into()), Effect::ResumeRequest])
        )],
        "steered before it is resumed: Envoy releases the headers on resume"
    );
}

#[test]
fn a_client_sent_pool_header_is_stripped_first_or_the_request_refused() {
    let mut host = Host::new("{}");
    let r = host.request_headers(1, &[A, ("x-llm-governor-pool", "premium")], true);
    assert_eq!(r.effects.first(), Some(&Effect::StripSteeringHeader));
    assert_eq!(r.action, Action::Continue);
    let r = host.call(|w, lent| w.failed(1, Failure::Strip, lent));
    assert_eq!(replies(&r), [400]);
}

#[test]
fn a_failed_resume_gives_back_what_the_request_took_and_a_failed_answer_lets_it_go() {
    let mut host = Host::new(r#"{"limits": [{"name": "cap", "key": "pool", "max_in_flight": 1}]}"#);
    host.request_headers(1, &[A], true);
    host.call(|w, lent| w.failed(1, Failure::Resume, lent));
    assert_eq!(host.worker.stage(1), Stage::Done);
    assert_eq!(
        host.request_headers(2, &[A], true).action,
        Action::Continue,
        "the slot came back"
    );
    let r = host.call(|w, lent| w.failed(3, Failure::Reply, lent));
    assert_eq!(r.action, Action::Continue, "fail open");
}

#[test]
fn a_stream_that_ends_twice_gives_its_slot_back_once() {
    let mut host = Host::new(CAP);
    let no_hold = [A, ("x-envoy-expected-rq-timeout-ms", "0")];
    host.request_headers(1, &no_hold, true);
    host.end(1);
    host.end(1);
    assert_eq!(
        host.request_headers(2, &no_hold, true).action,
        Action::Continue
    );
    let r = host.request_headers(3, &no_hold, true);
    assert_eq!(replies(&r), [429], "one slot, not two");
}

#[test]
fn usage_is_read_from_the_response_body_and_charged_at_the_stream_end() {
    let mut host = Host::new(
        r#"{"limits": [{"name": "tpm", "key": "pool", "tokens_per_minute": 600, "burst": 100, "settle": "usage"}]}"#,
    );
    let no_hold = [A, ("x-envoy-expected-rq-timeout-ms", "0")];
    host.request_headers(1, &no_hold, true);
    let usage = r#"{"usage":{"prompt_tokens":40,"completion_tokens":70,"total_tokens":110}}"#;
    host.response(1, 200, &[], usage);
    assert_eq!(
        host.request_headers(2, &no_hold, true).action,
        Action::Continue,
        "not charged yet"
    );
    host.end(2);
    host.end(1);
    // 110 tokens put the budget of 100 in debt: refused until it refills.
    let r = host.request_headers(3, &no_hold, true);
    let Some(Effect::SendReply(reply)) =
        r.effects.iter().find(|e| matches!(e, Effect::SendReply(_)))
    else {
        panic!("admitted while in debt: {r:?}");
    };
    assert_eq!(
        header(&reply.headers, "ratelimit-policy"),
        "\"tpm\";q=600;w=60"
    );
}

/// A 429 whose headers came without its body: the stream pauses for the body.
fn error_headers(host: &mut Host, id: u32) -> Reaction {
    let hs = owned(&[(":status", "429")]);
    host.call(|w, lent| {
        w.on_response_headers(
            id,
            &llm_governor_core::headers::Headers::new(&hs),
            false,
            lent,
        )
    })
}

#[test]
fn an_error_body_that_misses_its_wait_is_classified_on_what_arrived() {
    let mut host = Host::new("{}");
    host.request_headers(1, &[A], true);
    assert_eq!(error_headers(&mut host, 1).action, Action::Pause);
    // The first 60 bytes (the quota code among them) arrive; the rest trickles.
    host.io
        .response_bodies
        .insert(1, QUOTA.as_bytes()[..60].to_vec());
    body_part(&mut host, 1, 60);
    host.io.response_bodies.remove(&1); // the tick may read nothing of the buffer
    host.advance(BODY_WAIT_MS);
    let out = host.tick_reactions();
    assert_eq!(
        header(&set_headers(&out[0].1), "x-llm-governor-class"),
        "quota_exhausted"
    );
    assert_eq!(host.metrics.count_of(0, Counter::BodyUnavailable), 0);
}

/// A part of stream `id`'s response body: `buffered` bytes so far, more to come.
fn body_part(host: &mut Host, id: u32, buffered: usize) -> Reaction {
    host.call(|w, lent| w.on_response_body(id, buffered, false, lent))
}

#[test]
fn one_slow_error_body_changes_how_no_other_answer_is_read() {
    let mut host = Host::new("{}");
    // Body callbacks are seen to work on this worker: a quota 429 read whole.
    host.request_headers(1, &[A], true);
    error_headers(&mut host, 1);
    host.io.response_bodies.insert(1, QUOTA.as_bytes().to_vec());
    host.call(|w, lent| w.on_response_body(1, QUOTA.len(), true, lent));
    // Then one whose body does not come in time at all.
    host.request_headers(2, &[("authorization", "Bearer sk-slow")], true);
    error_headers(&mut host, 2);
    host.advance(BODY_WAIT_MS);
    let out = host.tick_reactions();
    assert_eq!(
        header(&set_headers(&out[0].1), "x-llm-governor-class"),
        "rate_limited"
    );
    // Another account's prompt quota 429 is still read by its body.
    host.request_headers(3, &[("authorization", "Bearer sk-other")], true);
    assert_eq!(
        error_headers(&mut host, 3),
        paused(vec![]),
        "still waits for its body"
    );
    host.io.response_bodies.insert(3, QUOTA.as_bytes().to_vec());
    let r = host.call(|w, lent| w.on_response_body(3, QUOTA.len(), true, lent));
    assert_eq!(
        header(&set_headers(&r), "x-llm-governor-class"),
        "quota_exhausted"
    );
    assert_eq!(host.metrics.count_of(0, Counter::BodyUnavailable), 0);
}

#[test]
fn on_a_worker_that_never_saw_a_body_callback_a_missing_body_still_means_headers_only() {
    let mut host = Host::new("{}");
    host.request_headers(1, &[A], true);
    error_headers(&mut host, 1);
    host.advance(BODY_WAIT_MS);
    host.tick_reactions();
    assert_eq!(host.metrics.count_of(0, Counter::BodyUnavailable), 1);
    host.request_headers(2, &[("authorization", "Bearer sk-b")], true);
    let r = error_headers(&mut host, 2);
    assert_eq!(
        r.action,
        Action::Continue,
        "classified from status and headers"
    );
    assert_eq!(
        header(&set_headers(&r), "x-llm-governor-class"),
        "rate_limited"
    );
}

#[test]
fn a_host_may_skip_exactly_the_body_chunks_the_worker_would_let_through_untouched() {
    let mut host = Host::new(RESERVING);
    host.request_headers(1, &[A], false);
    // Reading the body before admission: the worker wants the request body.
    assert!(host.worker.reads_body(1, Direction::Request));
    assert!(!host.worker.reads_body(1, Direction::Response));
    host.io.request_bodies.insert(1, BODY.to_vec());
    assert_eq!(
        body(&mut host, 1, BODY.len(), true).action,
        Action::Continue
    );
    // Upstream now: more request body is let through; the response body is scanned for usage
    // (this limit settles with it).
    assert!(!host.worker.reads_body(1, Direction::Request));
    assert_eq!(
        body(&mut host, 1, 10, true),
        Reaction {
            effects: vec![],
            action: Action::Continue
        }
    );
    // A stream the worker does not know: nothing to read.
    assert!(
        !host.worker.reads_body(99, Direction::Request)
            && !host.worker.reads_body(99, Direction::Response)
    );
    // With `{}`, a forwarded request's bodies are never needed.
    let mut plain = Host::new("{}");
    plain.request_headers(1, &[A], false);
    assert!(
        !plain.worker.reads_body(1, Direction::Request)
            && !plain.worker.reads_body(1, Direction::Response)
    );
}
