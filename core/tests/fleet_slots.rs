//! `max_in_flight` with `scope: "fleet"` through the worker: a slot is a hold of 1 on the
//! service for the lease (Reserve), given back with a Commit of 0 when the stream ends however
//! it ends; a full cap holds the request and asks again soon; a service that cannot answer
//! leaves `on_error` to decide (`local`: this Envoy's own cap of the same size).

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::reactions::{calls, replied};
use common::*;
use llm_governor_core::fleet::ask::SLOT_REASK_MS;
use llm_governor_core::fleet::grpc::{Method, ServiceReply};
use llm_governor_core::metrics::Counter;
use llm_governor_core::worker::{Action, Effect, Reaction, Stage};

const CAP: &str = r#"{"fleet": {"cluster": "rls", "timeout_ms": 50, "on_error": "local"},
  "limits": [{"name": "slots", "key": "header:x-tenant-id", "max_in_flight": 1, "scope": "fleet",
              "slot_lease_ms": 30000}],
  "hold": {"max_ms": 10000}}"#;

const TENANT: &[(&str, &str)] = &[("x-tenant-id", "acme"), ("x-stainless-timeout", "30")];

/// Stream `id` asks for a slot; the service answers `reply`. The Reserve it sent, and what
/// the answer did.
fn ask(h: &mut Host, id: u32, reply: &[u8]) -> (Vec<u8>, Reaction) {
    let r = h.request_headers(id, TENANT, true);
    assert_eq!(r.action, Action::Pause);
    let asked = calls(&r);
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert_eq!(asked[0].method, Method::Reserve);
    let r = h.service_answer(id, asked[0].seq, ServiceReply::Message(reply));
    (asked[0].message.clone(), r)
}

#[test]
fn a_slot_is_a_hold_of_one_for_the_lease_given_back_with_a_commit_of_zero() {
    let mut h = Host::new(CAP);
    let (reserve, r) = ask(&mut h, 3, &reserve_answer(1, "slot-7"));
    assert!(contains(&reserve, b"slots") && contains(&reserve, b"acme"));
    // amount = 1 (field 3), ttl = 30 s (field 4: a Duration of 30 seconds).
    assert!(
        contains(&reserve, &[0x18, 1, 0x22, 2, 0x08, 30]),
        "{reserve:?}"
    );
    assert!(r.effects.contains(&Effect::ResumeRequest), "{r:?}");
    h.response(3, 200, &[("content-type", "application/json")], "{}");
    h.end(3);
    let owed = h.worker.calls().take_owed();
    assert_eq!(owed.len(), 1, "{owed:?}");
    assert_eq!(owed[0].method, Method::Commit);
    assert!(contains(&owed[0].message, b"slot-7"));
    assert!(
        owed[0].message.ends_with(&[0x20, 0]),
        "actual_amount 0: {:?}",
        owed[0].message
    );
}

#[test]
fn a_stream_reset_before_its_response_gives_its_slot_back() {
    let mut h = Host::new(CAP);
    let (_, r) = ask(&mut h, 3, &reserve_answer(1, "slot-9"));
    assert!(r.effects.contains(&Effect::ResumeRequest));
    h.end(3);
    let owed = h.worker.calls().take_owed();
    assert_eq!(owed.len(), 1, "{owed:?}");
    assert!(contains(&owed[0].message, b"slot-9") && owed[0].message.ends_with(&[0x20, 0]));
}

#[test]
fn a_full_cap_holds_the_request_and_asks_again_soon() {
    let mut h = Host::new(CAP);
    let (_, r) = ask(&mut h, 1, &reserve_answer(2, ""));
    assert!(replied(&r).is_none() && r.action == Action::Pause, "{r:?}");
    assert_eq!(h.worker.stage(1), Stage::Held);
    assert_eq!(h.count(Counter::FleetCallsOverLimit), 1);
    // Not at the window's reset (a cap has none): within the re-ask period.
    let mut waited = 0;
    let again = loop {
        h.advance(1);
        waited += 1;
        assert!(waited <= 2 * SLOT_REASK_MS, "never asked again");
        let left = h.tick_reactions();
        if let Some((_, r)) = left.first() {
            break calls(r);
        }
    };
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].method, Method::Reserve);
    let r = h.service_answer(
        1,
        again[0].seq,
        ServiceReply::Message(&reserve_answer(1, "s")),
    );
    assert!(r.effects.contains(&Effect::ResumeRequest), "{r:?}");
}

#[test]
fn without_hold_a_full_cap_is_a_local_429_of_source_limit() {
    let mut h = Host::new(&CAP.replace(r#""max_ms": 10000"#, r#""max_ms": 0"#));
    let (_, r) = ask(&mut h, 1, &reserve_answer(2, ""));
    let reply = replied(&r).expect("answered locally");
    assert_eq!(reply.status, 429);
    assert_eq!(header(&reply.headers, "x-llm-governor-source"), "limit");
    assert_eq!(h.worker.stage(1), Stage::Done);
}

#[test]
fn a_slot_the_service_cannot_hold_leaves_on_error_local_to_this_envoys_own_cap() {
    // A failed call, or an OK without a hold (a server run with a reservation fraction below
    // 1/cap clamps the hold away): this Envoy's own cap of the same size decides.
    let garbage: &[u8] = b"\xff\xff garbage";
    for reply in [garbage, &reserve_answer(1, "")] {
        let mut h = Host::new(CAP);
        let (_, r) = ask(&mut h, 1, reply);
        assert!(r.effects.contains(&Effect::ResumeRequest), "{r:?}");
        assert_eq!(h.count(Counter::FleetFallback), 1);
        // The local cap is now full: the next one answered so waits.
        let (_, r) = ask(&mut h, 2, reply);
        assert!(replied(&r).is_none());
        assert_eq!(h.worker.stage(2), Stage::Held);
        // The first stream ends: nothing owed to the service (it holds no slot).
        h.end(1);
        assert!(h.worker.calls().take_owed().is_empty());
    }
}

/// `CAP` with a lease of 3 s: a slot's hold is taken again 2 s into it.
fn short_lease() -> String {
    CAP.replace("\"slot_lease_ms\": 30000", "\"slot_lease_ms\": 3000")
}

/// The calls the worker owes now (sent), and the answer `reply` of the one at `at`.
fn owed(h: &mut Host) -> Vec<llm_governor_core::fleet::grpc::ServiceCall> {
    h.worker.calls().take_owed()
}

fn answer_owed(h: &mut Host, call: &llm_governor_core::fleet::grpc::ServiceCall, reply: &[u8]) {
    let token = 1_000_000 + u64::from(call.seq);
    h.worker.calls().sent(None, token, call.seq);
    let r = h.call(|w, lent| w.on_call_done(None, token, ServiceReply::Message(reply), lent));
    assert!(r.is_none(), "{r:?}");
}

/// A Commit of 0 of `id`.
fn gives_back(call: &llm_governor_core::fleet::grpc::ServiceCall, id: &str) -> bool {
    call.method == Method::Commit
        && contains(&call.message, id.as_bytes())
        && call.message.ends_with(&[0x20, 0])
}

#[test]
fn a_stream_longer_than_its_lease_takes_its_slot_again_beside_the_old_one() {
    let mut h = Host::new(&short_lease());
    let (_, r) = ask(&mut h, 3, &reserve_answer(1, "slot-7"));
    assert!(r.effects.contains(&Effect::ResumeRequest));
    assert_eq!(
        h.worker.next_due_ms(),
        Some(h.now_ms + 2_000),
        "taken again 2 s into 3 s"
    );
    h.advance(1_999);
    h.tick_reactions();
    assert!(owed(&mut h).is_empty(), "not before");
    h.advance(1);
    h.tick_reactions();
    let renew = owed(&mut h);
    assert_eq!(renew.len(), 1, "{renew:?}");
    assert_eq!(renew[0].method, Method::Reserve);
    assert!(contains(&renew[0].message, b"acme"));
    // Granted beside the old hold: the old one is given back, the new one kept.
    answer_owed(&mut h, &renew[0], &reserve_answer(1, "slot-8"));
    let after = owed(&mut h);
    assert!(
        after.len() == 1 && gives_back(&after[0], "slot-7"),
        "{after:?}"
    );
    assert_eq!(h.worker.next_due_ms(), Some(h.now_ms + 2_000));
    h.end(3);
    let end = owed(&mut h);
    assert!(end.len() == 1 && gives_back(&end[0], "slot-8"), "{end:?}");
}

/// Stream 3 holds "slot-7" under a 3 s lease; 2 s in, its renewal finds the cap full, and the
/// service sees the new Reserve before the old hold's release: what the worker owes then (the
/// Reserve once more).
fn full_at_renewal() -> (Host, Vec<llm_governor_core::fleet::grpc::ServiceCall>) {
    let mut h = Host::new(&short_lease());
    ask(&mut h, 3, &reserve_answer(1, "slot-7"));
    h.advance(2_000);
    h.tick_reactions();
    let renew = owed(&mut h);
    answer_owed(&mut h, &renew[0], &reserve_answer(2, ""));
    // The old hold's release and a new Reserve, together.
    let both = owed(&mut h);
    assert_eq!(both.len(), 2, "{both:?}");
    assert!(
        gives_back(&both[0], "slot-7") && both[1].method == Method::Reserve,
        "{both:?}"
    );
    answer_owed(&mut h, &both[1], &reserve_answer(2, ""));
    let last = owed(&mut h);
    assert!(
        last.len() == 1 && last[0].method == Method::Reserve,
        "{last:?}"
    );
    (h, last)
}

#[test]
fn with_the_cap_full_the_old_hold_is_given_back_and_a_new_one_taken_at_once() {
    // Granted the second time.
    let (mut h, last) = full_at_renewal();
    answer_owed(&mut h, &last[0], &reserve_answer(1, "slot-9"));
    assert!(owed(&mut h).is_empty());
    assert_eq!(h.worker.next_due_ms(), Some(h.now_ms + 2_000));
    h.end(3);
    let end = owed(&mut h);
    assert!(end.len() == 1 && gives_back(&end[0], "slot-9"), "{end:?}");
    // Taken by a waiting request instead: the stream goes on past its slot, counted.
    let (mut h, last) = full_at_renewal();
    let over = h.count(Counter::FleetCallsOverLimit);
    answer_owed(&mut h, &last[0], &reserve_answer(2, ""));
    assert_eq!(h.count(Counter::FleetCallsOverLimit), over + 1);
    assert_eq!(h.worker.next_due_ms(), None, "not asked again");
}

#[test]
fn a_hold_granted_after_its_stream_ended_is_given_back() {
    let mut h = Host::new(&short_lease());
    ask(&mut h, 3, &reserve_answer(1, "slot-7"));
    h.advance(2_000);
    h.tick_reactions();
    let renew = owed(&mut h);
    h.end(3);
    let end = owed(&mut h);
    assert!(end.len() == 1 && gives_back(&end[0], "slot-7"), "{end:?}");
    answer_owed(&mut h, &renew[0], &reserve_answer(1, "slot-8"));
    let late = owed(&mut h);
    assert!(
        late.len() == 1 && gives_back(&late[0], "slot-8"),
        "{late:?}"
    );
    assert!(contains(&late[0].message, b"acme"), "on the slot's own key");
}
