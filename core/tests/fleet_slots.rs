//! `max_in_flight` with `scope: "fleet"` through the worker: a slot is a hold of 1 on the
//! service's cap and its guard for the lease (Reserve), each taken again on its own while the
//! stream lasts, given back with a Commit of 0 when the stream ends however it ends; a full cap
//! holds the request and asks again soon; a service that cannot answer leaves `on_error` to
//! decide (`local`: this Envoy's own cap of the same size).

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

/// Which entries of a call's descriptor name the limit: (`limit`, `guard`).
fn names(call: &llm_governor_core::fleet::grpc::ServiceCall) -> (bool, bool) {
    (
        contains(&call.message, b"limit"),
        contains(&call.message, b"guard"),
    )
}

const CAP_ONLY: (bool, bool) = (true, false);
const GUARD_ONLY: (bool, bool) = (false, true);
const BOTH: (bool, bool) = (true, true);

/// A Reserve of 1 on the slot's cap or guard (`part`), for tenant acme.
fn renews(call: &llm_governor_core::fleet::grpc::ServiceCall, part: (bool, bool)) -> bool {
    call.method == Method::Reserve && names(call) == part && contains(&call.message, b"acme")
}

/// The one call owed now, which must be `what`.
fn one(
    h: &mut Host,
    what: impl Fn(&llm_governor_core::fleet::grpc::ServiceCall) -> bool,
) -> llm_governor_core::fleet::grpc::ServiceCall {
    let mut owed = owed(h);
    assert!(owed.len() == 1 && what(&owed[0]), "{owed:?}");
    owed.remove(0)
}

/// Stream 3 holds "slot-7" under a 3 s lease, 2 s in: its renewal is owed.
fn renewing() -> Host {
    let mut h = Host::new(&short_lease());
    ask(&mut h, 3, &reserve_answer(1, "slot-7"));
    h.advance(2_000);
    h.tick_reactions();
    h
}

/// 2 s on, stream 3's cap is asked for again and granted `id`.
fn cap_renewed(h: &mut Host, id: &str) {
    h.advance(2_000);
    h.tick_reactions();
    let cap = one(h, |c| renews(c, CAP_ONLY));
    answer_owed(h, &cap, &reserve_answer(1, id));
}

/// Stream 3 ends: its cap's hold `cap` and its guard's `guard` are given back, each on its own.
fn ends_giving_back(h: &mut Host, cap: &str, guard: &str) {
    h.end(3);
    let end = owed(h);
    assert_eq!(end.len(), 2, "{end:?}");
    assert!(
        gives_back(&end[0], cap) && names(&end[0]) == CAP_ONLY,
        "{end:?}"
    );
    assert!(
        gives_back(&end[1], guard) && names(&end[1]) == GUARD_ONLY,
        "{end:?}"
    );
}

#[test]
fn admission_asks_the_cap_and_its_guard_in_one_reserve() {
    let mut h = Host::new(CAP);
    let (reserve, _) = ask(&mut h, 3, &reserve_answer(1, "slot-7"));
    let call = llm_governor_core::fleet::grpc::ServiceCall {
        seq: 0,
        method: Method::Reserve,
        message: reserve,
        timeout_ms: 0,
    };
    assert_eq!(names(&call), BOTH);
    // Given back in one Commit while both holds are still admission's.
    h.end(3);
    let end = one(&mut h, |c| gives_back(c, "slot-7"));
    assert_eq!(names(&end), BOTH);
}

#[test]
fn a_stream_longer_than_its_lease_takes_its_cap_then_its_guard_again_beside_the_old_ones() {
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
    let cap = one(&mut h, |c| renews(c, CAP_ONLY));
    // Granted beside the old hold: the cap's old hold is given back, then the guard asked.
    answer_owed(&mut h, &cap, &reserve_answer(1, "cap-8"));
    let after = owed(&mut h);
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(
        gives_back(&after[0], "slot-7") && names(&after[0]) == CAP_ONLY,
        "{after:?}"
    );
    assert!(renews(&after[1], GUARD_ONLY), "{after:?}");
    assert_eq!(
        h.worker.next_due_ms(),
        None,
        "not armed while the guard is asked"
    );
    answer_owed(&mut h, &after[1], &reserve_answer(1, "guard-8"));
    let g = one(&mut h, |c| gives_back(c, "slot-7"));
    assert_eq!(names(&g), GUARD_ONLY);
    assert_eq!(h.worker.next_due_ms(), Some(h.now_ms + 2_000));
    // The end gives each back on its own limit.
    ends_giving_back(&mut h, "cap-8", "guard-8");
}

/// Stream 3 holds "slot-7" under a 3 s lease; 2 s in, the renewal of `part` finds it full,
/// and the service sees the new Reserve before the old hold's release: what the worker owes
/// then (the Reserve once more). The cap's renewal is granted "cap-8" beside when `part` is
/// the guard.
fn full_at_renewal(part: (bool, bool)) -> (Host, llm_governor_core::fleet::grpc::ServiceCall) {
    let mut h = renewing();
    let mut renew = one(&mut h, |c| renews(c, CAP_ONLY));
    if part == GUARD_ONLY {
        answer_owed(&mut h, &renew, &reserve_answer(1, "cap-8"));
        let after = owed(&mut h);
        renew = after[1].clone();
    }
    answer_owed(&mut h, &renew, &reserve_answer(2, ""));
    // The old hold's release on that limit alone and a new Reserve, together.
    let both = owed(&mut h);
    assert_eq!(both.len(), 2, "{both:?}");
    assert!(
        gives_back(&both[0], "slot-7") && names(&both[0]) == part,
        "{both:?}"
    );
    assert!(renews(&both[1], part), "{both:?}");
    answer_owed(&mut h, &both[1], &reserve_answer(2, ""));
    let last = one(&mut h, |c| renews(c, part));
    (h, last)
}

#[test]
fn with_a_limit_full_its_old_hold_is_given_back_and_a_new_one_taken_at_once() {
    // The cap granted the second time: then the guard.
    let (mut h, last) = full_at_renewal(CAP_ONLY);
    answer_owed(&mut h, &last, &reserve_answer(1, "cap-9"));
    let guard = one(&mut h, |c| renews(c, GUARD_ONLY));
    answer_owed(&mut h, &guard, &reserve_answer(1, "guard-9"));
    one(&mut h, |c| {
        gives_back(c, "slot-7") && names(c) == GUARD_ONLY
    });
    assert_eq!(h.worker.next_due_ms(), Some(h.now_ms + 2_000));
    // The guard granted the second time.
    let (mut h, last) = full_at_renewal(GUARD_ONLY);
    answer_owed(&mut h, &last, &reserve_answer(1, "guard-9"));
    assert!(owed(&mut h).is_empty());
    assert_eq!(h.worker.next_due_ms(), Some(h.now_ms + 2_000));
    ends_giving_back(&mut h, "cap-8", "guard-9");
}

#[test]
fn a_hold_taken_by_a_waiting_request_is_counted_and_asked_for_again_at_the_next_renewal() {
    let (mut h, last) = full_at_renewal(CAP_ONLY);
    let over = h.count(Counter::FleetCallsOverLimit);
    answer_owed(&mut h, &last, &reserve_answer(2, ""));
    assert_eq!(h.count(Counter::FleetCallsOverLimit), over + 1);
    // The guard is still taken again (it keeps waiting requests out while it is held).
    let guard = one(&mut h, |c| renews(c, GUARD_ONLY));
    answer_owed(&mut h, &guard, &reserve_answer(1, "guard-9"));
    one(&mut h, |c| {
        gives_back(c, "slot-7") && names(c) == GUARD_ONLY
    });
    // Next renewal: the cap is asked for beside (nothing of it to give back), granted.
    cap_renewed(&mut h, "cap-10");
    one(&mut h, |c| renews(c, GUARD_ONLY));
    ends_giving_back(&mut h, "cap-10", "guard-9");
}

#[test]
fn a_service_without_the_guard_leaves_the_slot_to_the_cap_alone_and_is_not_asked_again() {
    let mut h = Host::new(&short_lease());
    ask(&mut h, 3, &reserve_answer(1, "slot-7"));
    cap_renewed(&mut h, "cap-8");
    let guard = owed(&mut h).remove(1);
    // No limit matches the guard: the service grants it holding nothing.
    answer_owed(&mut h, &guard, &reserve_answer(1, ""));
    assert!(owed(&mut h).is_empty(), "nothing of a guard to give back");
    assert_eq!(h.count(Counter::FleetErrors), 0);
    cap_renewed(&mut h, "cap-9");
    one(&mut h, |c| gives_back(c, "cap-8") && names(c) == CAP_ONLY);
    h.end(3);
    one(&mut h, |c| gives_back(c, "cap-9") && names(c) == CAP_ONLY);
}

#[test]
fn a_hold_granted_after_its_stream_ended_is_given_back() {
    let mut h = renewing();
    let renew = owed(&mut h);
    h.end(3);
    one(&mut h, |c| gives_back(c, "slot-7") && names(c) == BOTH);
    answer_owed(&mut h, &renew[0], &reserve_answer(1, "slot-8"));
    let late = one(&mut h, |c| gives_back(c, "slot-8"));
    assert_eq!(names(&late), CAP_ONLY, "on the limit it was granted on");
    assert!(contains(&late.message, b"acme"), "on the slot's own key");
}

#[test]
fn a_renewal_step_that_could_not_be_sent_is_a_failed_one_and_the_renewal_goes_on() {
    let mut h = renewing();
    let cap = one(&mut h, |c| renews(c, CAP_ONLY));
    h.call(|w, lent| w.call_not_sent(cap.seq, lent));
    assert_eq!(h.count(Counter::FleetErrors), 1);
    // The old hold of the cap is kept (nothing reached the service); the guard is asked.
    let guard = one(&mut h, |c| renews(c, GUARD_ONLY));
    h.call(|w, lent| w.call_not_sent(guard.seq, lent));
    assert_eq!(h.count(Counter::FleetErrors), 2);
    assert!(owed(&mut h).is_empty());
    // Asked again at the next renewal, not given up.
    assert_eq!(h.worker.next_due_ms(), Some(h.now_ms + 2_000));
    cap_renewed(&mut h, "cap-9");
    let after = owed(&mut h);
    assert!(
        gives_back(&after[0], "slot-7") && names(&after[0]) == CAP_ONLY,
        "{after:?}"
    );
    assert!(
        after.len() == 2 && renews(&after[1], GUARD_ONLY),
        "{after:?}"
    );
}
