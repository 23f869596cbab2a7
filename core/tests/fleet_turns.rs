//! Cooldowns shared by a fleet (`fleet::turn`): three Envoys (three hosts, each its own shared
//! data) learn a cooldown from their own 429s, and what the cooldown's pace then lets go leaves
//! from one of them at a time, the one holding the (pool, account)'s turn on a fake rate-limit
//! service that holds one reservation at a time, as Limitador's Reserve does on a limit whose
//! `max_value` is 1.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::provider::{A, PATH, RL};
use common::*;
use llm_governor_core::effects::{Action, Effect, Reaction};
use llm_governor_core::fleet::grpc::{Method, ServiceCall, ServiceReply};
use llm_governor_core::fleet::watch::PEEK_MS;
use llm_governor_core::metrics::Counter;
use llm_governor_core::worker::Stage;

const CFG: &str = r#"{"fleet": {"cluster": "rls", "timeout_ms": 50, "cooldowns": true}, "hold": {"max_ms": 10000}}"#;

/// The service's limit `llm_governor_turn`: one hold at a time, until its ttl; and its limit
/// `llm_governor_cooling` (`max_value: 1`, `seconds: 1`), a fixed window from its first hit,
/// for the account's key and the fleet's (`*`).
#[derive(Default)]
struct TurnService {
    holder: Option<(String, u64)>,
    issued: u32,
    down: bool,
    /// The account's marker, then the fleet's: its window ends here (its count is 1 until then).
    marked_until: [u64; 2],
    /// The checks of the account's marker and the hits on it; the same of the fleet's.
    peeks: u32,
    marks: u32,
    any_peeks: u32,
    any_marks: u32,
}

fn is_marker(call: &ServiceCall) -> bool {
    contains(&call.message, b"llm_governor_cooling")
}

/// Which marker a call is about: the account's (0) or the fleet's (1, the value `*`).
fn marker(call: &ServiceCall) -> usize {
    usize::from(contains(&call.message, &[0x12, 1, b'*']))
}

impl TurnService {
    fn answer(&mut self, call: &ServiceCall, now: u64) -> Option<Vec<u8>> {
        if self.down {
            return None;
        }
        Some(match call.method {
            Method::Reserve => match &self.holder {
                Some((_, until)) if *until > now => reserve_answer(2, ""),
                _ => {
                    self.issued += 1;
                    let id = format!("turn-{}", self.issued);
                    self.holder = Some((id.clone(), now + ttl_ms(&call.message)));
                    reserve_answer(1, &id)
                }
            },
            Method::Commit => {
                let held = self.holder.as_ref().map(|(id, _)| id.as_bytes().to_vec());
                if held.is_some_and(|id| call.message.windows(id.len()).any(|w| w == id)) {
                    self.holder = None;
                }
                vec![0x08, 1]
            }
            Method::ShouldRateLimit if is_marker(call) => {
                let m = marker(call);
                *[&mut self.marks, &mut self.any_marks][m] += 1;
                if self.marked_until[m] > now {
                    rls_answer(2, None)
                } else {
                    self.marked_until[m] = now + 1_000;
                    rls_answer(1, None)
                }
            }
            Method::ShouldRateLimit => rls_answer(1, None),
            Method::CheckRateLimit => {
                assert!(is_marker(call), "only the markers are checked");
                let m = marker(call);
                *[&mut self.peeks, &mut self.any_peeks][m] += 1;
                rls_answer(if self.marked_until[m] > now { 2 } else { 1 }, None)
            }
        })
    }
}

/// A varint at `b[*at..]`, moving `at` past it.
fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            break;
        }
    }
    v
}

/// The ttl a `ReserveRequest` asks for (field 4, a `Duration{seconds = 1, nanos = 2}`), in ms.
fn ttl_ms(message: &[u8]) -> u64 {
    let mut at = 0;
    while at < message.len() {
        let key = varint(message, &mut at);
        match key & 7 {
            0 => {
                varint(message, &mut at);
            }
            2 => {
                let len = usize::try_from(varint(message, &mut at)).unwrap();
                let body = &message[at..at + len];
                at += len;
                if key >> 3 == 4 {
                    let (mut i, mut ms) = (0, 0);
                    while i < body.len() {
                        let k = varint(body, &mut i);
                        let v = varint(body, &mut i);
                        ms += if k >> 3 == 1 { v * 1000 } else { v / 1_000_000 };
                    }
                    return ms;
                }
            }
            w => panic!("wire type {w} in a ReserveRequest"),
        }
    }
    panic!("a ReserveRequest without a ttl")
}

/// Send the calls a reaction of stream `id` makes, answer them, and follow what the answers
/// do: the reactions of stream `id`, in order.
fn pump(h: &mut Host, svc: &mut TurnService, id: u32, r: Reaction) -> Vec<Reaction> {
    let mut out = vec![r.clone()];
    for e in &r.effects {
        let Effect::CallService(call) = e else {
            continue;
        };
        let token = u64::from(call.seq);
        h.worker.calls().sent(Some(id), token, call.seq);
        let bytes = svc.answer(call, h.now_ms);
        let reply = match &bytes {
            Some(b) => ServiceReply::Message(b),
            None => ServiceReply::Failed(14),
        };
        if let Some((sid, next)) = h.call(|w, lent| w.on_call_done(Some(id), token, reply, lent)) {
            out.extend(pump(h, svc, sid, next));
        }
    }
    out
}

/// Send the calls a host owes the service (commits, a turn given back) and answer them, and
/// what their answers owe, as the hosts do.
fn pump_owed(h: &mut Host, svc: &mut TurnService) {
    while h.worker.calls().owes() {
        pump_owed_once(h, svc);
    }
}

fn pump_owed_once(h: &mut Host, svc: &mut TurnService) {
    for call in h.worker.calls().take_owed() {
        let token = 1_000_000 + u64::from(call.seq);
        h.worker.calls().sent(None, token, call.seq);
        let bytes = svc.answer(&call, h.now_ms);
        let reply = match &bytes {
            Some(b) => ServiceReply::Message(b),
            None => ServiceReply::Failed(14),
        };
        h.call(|w, lent| w.on_call_done(None, token, reply, lent));
    }
}

/// A tick of host `h`, with its calls sent and answered: the streams that went upstream.
fn tick(h: &mut Host, svc: &mut TurnService) -> Vec<u32> {
    let mut went = Vec::new();
    for (id, r) in h.tick_reactions() {
        for r in pump(h, svc, id, r) {
            if r.effects.contains(&Effect::ResumeRequest) || r.action == Action::Continue {
                went.push(id);
            }
        }
    }
    pump_owed(h, svc);
    went
}

/// A success with room: 9 of 10 requests left in the provider's window.
const ROOM: [(&str, &str); 2] = [
    ("x-ratelimit-remaining-requests", "9"),
    ("x-ratelimit-limit-requests", "10"),
];

/// Stream `id` of the account arrives at host `h`, its calls answered: whether it went.
fn request(h: &mut Host, svc: &mut TurnService, id: u32) -> bool {
    let r = h.request_headers(id, &[A], true);
    pump(h, svc, id, r)
        .iter()
        .any(|r| r.action == Action::Continue || r.effects.contains(&Effect::ResumeRequest))
}

/// Three Envoys whose first requests all went before any answer came (nothing cooled: they
/// asked nothing on their way), each met the provider's 429 (`retry-after: 1`), and
/// each holds a request of the account (stream 2) through it.
fn cooled_fleet(svc: &mut TurnService) -> Vec<Host> {
    let mut fleet: Vec<Host> = (0..3).map(|_| Host::new(CFG)).collect();
    for h in &mut fleet {
        assert!(request(h, svc, 1), "nothing cools yet");
    }
    for h in &mut fleet {
        h.respond(1, 429, &[("retry-after", "1")], RL);
        h.end(1);
        pump_owed(h, svc);
        assert!(matches!(h.arrive(2, PATH, &[A]), Step::Held));
    }
    fleet
}

/// The holder's (`fleet[0]`) probe, stream `probe`, succeeds with room: with nothing more to
/// send it gives the turn back, and of the others one Envoy at a time goes: exactly one sends
/// its held request (stream 2).
fn recovered(fleet: &mut [Host], svc: &mut TurnService, probe: u32) {
    fleet[0].respond(probe, 200, &ROOM, "{}");
    fleet[0].end(probe);
    assert_eq!(tick(&mut fleet[0], svc), Vec::<u32>::new());
    assert!(svc.holder.is_none(), "the turn was given back");
    let went = round(&mut fleet[1..], 60, svc);
    assert_eq!(went.concat(), vec![2], "one Envoy at a time: {went:?}");
}

/// A round `ms` later in which the holder (`fleet[0]`) sends `sent` and no other Envoy
/// sends anything.
fn only_the_holder_sends(
    fleet: &mut [Host],
    ms: u64,
    svc: &mut TurnService,
    sent: &[u32],
    why: &str,
) {
    let went = round(fleet, ms, svc);
    assert_eq!(went, vec![sent.to_vec(), vec![], vec![]], "{why}");
}

/// Every Envoy of the fleet `ms` later, then ticked: what each sent.
fn round(fleet: &mut [Host], ms: u64, svc: &mut TurnService) -> Vec<Vec<u32>> {
    fleet
        .iter_mut()
        .map(|h| {
            h.advance(ms);
            tick(h, svc)
        })
        .collect()
}

#[test]
fn a_provider_round_costs_the_fleet_one_probe_and_the_turn_passes_when_it_has_room() {
    let mut svc = TurnService::default();
    let mut fleet = cooled_fleet(&mut svc);
    // The cooldown ends on every Envoy: each asks for the turn; only the first gets it.
    only_the_holder_sends(
        &mut fleet,
        1_000 + 1,
        &mut svc,
        &[2],
        "one probe for the fleet",
    );
    assert_eq!(fleet[1].worker.stage(2), Stage::Held);
    assert_eq!(fleet[2].worker.stage(2), Stage::Held);
    // The others ask again about every TURN_REASK_MS while it is held.
    for h in &mut fleet[1..] {
        h.advance(100);
        assert_eq!(tick(h, &mut svc), Vec::<u32>::new());
    }
    // The probe meets another 429: the holder keeps the turn through the new cooldown (a
    // cooldown never shortens, and nobody else probes meanwhile).
    fleet[0].respond(2, 429, &[("retry-after", "1")], RL);
    fleet[0].end(2);
    assert!(matches!(fleet[0].arrive(3, PATH, &[A]), Step::Held));
    only_the_holder_sends(&mut fleet, 500, &mut svc, &[], "nobody probes mid-cooldown");
    only_the_holder_sends(
        &mut fleet,
        600,
        &mut svc,
        &[3],
        "the next round's one probe is the holder's",
    );
    // The provider recovered.
    recovered(&mut fleet, &mut svc, 3);
}

#[test]
fn with_the_service_down_each_envoy_keeps_its_own_cooldown_and_says_so() {
    let mut svc = TurnService {
        down: true,
        ..TurnService::default()
    };
    let mut fleet = cooled_fleet(&mut svc);
    let went = round(&mut fleet, 1_000 + 1, &mut svc);
    assert_eq!(
        went,
        vec![vec![2], vec![2], vec![2]],
        "one probe per Envoy, as without a fleet"
    );
    // Each Envoy counts what failed: the two marks and the turn taken at its 429, the timer's
    // check of the fleet's marker, then its probe's turn, which fell back to its own cooldown.
    for h in &fleet {
        assert_eq!(h.metrics.count_of(0, Counter::FleetFallback), 1);
        assert_eq!(h.metrics.count_of(0, Counter::FleetErrors), 5);
    }
}

/// Stream `id` of the account goes at once, with no call to the service.
fn goes_asking_nothing(h: &mut Host, id: u32) {
    let r = h.request_headers(id, &[A], true);
    assert_eq!(r.action, Action::Continue, "{r:?}");
    assert!(!r
        .effects
        .iter()
        .any(|e| matches!(e, Effect::CallService(_))));
}

#[test]
fn nothing_is_asked_on_a_requests_way_while_nothing_is_cooling() {
    let mut svc = TurnService::default();
    let mut h = Host::new(CFG);
    // From the start the worker's timer checks the fleet's marker every PEEK_MS; no request
    // asks anything, the first of the account included, and no account's marker is checked.
    for id in 10..30 {
        goes_asking_nothing(&mut h, id);
        h.advance(50);
        tick(&mut h, &mut svc);
    }
    assert_eq!(svc.any_peeks, 10, "one check per PEEK_MS over 1 s");
    assert_eq!((svc.peeks, svc.marks, svc.any_marks), (0, 0, 0));
    assert_eq!(
        h.worker.tick_ms(),
        Some(PEEK_MS),
        "an idle worker ticks every PEEK_MS"
    );
}

#[test]
fn an_envoy_learns_another_envoys_cooldown_before_its_own_first_429() {
    let mut svc = TurnService::default();
    let (mut a, mut warm, mut cold) = (Host::new(CFG), Host::new(CFG), Host::new(CFG));
    // `warm` sent to the account a moment ago (and got its answer); `cold` never did.
    assert!(request(&mut warm, &mut svc, 1));
    warm.respond(1, 200, &[], "{}");
    warm.end(1);
    // `a` meets the provider's 429: it marks the account and the fleet, and takes its turn.
    assert!(request(&mut a, &mut svc, 1));
    a.respond(1, 429, &[("retry-after", "1")], RL);
    a.end(1);
    pump_owed(&mut a, &mut svc);
    assert_eq!((svc.marks, svc.any_marks), (1, 1));
    assert!(svc.holder.is_some(), "the turn is taken at the 429");
    // Within PEEK_MS each timer finds the fleet's marker; the warm Envoy checks the account's
    // at once: its next request is held, and asks for the turn (which `a` holds), instead of
    // meeting a 429 of its own.
    for h in [&mut a, &mut warm, &mut cold] {
        h.advance(100);
    }
    tick(&mut warm, &mut svc);
    assert_eq!(
        (svc.any_peeks, svc.peeks),
        (1, 1),
        "the fleet's, then the account's"
    );
    assert!(!request(&mut warm, &mut svc, 2));
    assert_eq!(warm.worker.stage(2), Stage::Held);
    // The cold Envoy's first request checks the account's marker on its way: held too.
    tick(&mut cold, &mut svc);
    assert!(!request(&mut cold, &mut svc, 2));
    assert_eq!(svc.peeks, 2);
    assert_eq!(cold.worker.stage(2), Stage::Held);
    // Through the cooldown `a` keeps the account marked, and nobody else sends.
    assert!(matches!(a.arrive(2, PATH, &[A]), Step::Held));
    let mut fleet = [a, warm, cold];
    for _ in 0..4 {
        let went = round(&mut fleet, 200, &mut svc);
        assert_eq!(went, vec![Vec::<u32>::new(), vec![], vec![]]);
    }
    assert!(svc.marks >= 3, "marked every MARK_MS: {}", svc.marks);
    // The cooldown ends: the one probe of the fleet is the holder's.
    only_the_holder_sends(&mut fleet, 101, &mut svc, &[2], "one probe for the fleet");
    recovered(&mut fleet, &mut svc, 2);
}

#[test]
fn a_success_that_says_the_window_is_spent_cools_the_fleet_too() {
    let mut svc = TurnService::default();
    let (mut a, mut b) = (Host::new(CFG), Host::new(CFG));
    assert!(request(&mut b, &mut svc, 1));
    b.respond(1, 200, &ROOM, "{}");
    b.end(1);
    // `a`'s success says the provider's window has nothing left for 2 s: `a` cools (as
    // without a fleet), marks the account for the fleet and takes its turn.
    assert!(request(&mut a, &mut svc, 1));
    let spent = [
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-limit-requests", "10"),
        ("x-ratelimit-reset-requests", "2s"),
    ];
    a.respond(1, 200, &spent, "{}");
    a.end(1);
    pump_owed(&mut a, &mut svc);
    assert_eq!((svc.marks, svc.any_marks), (1, 1));
    assert!(svc.holder.is_some(), "the turn is taken");
    // `b` finds the fleet's marker within PEEK_MS, then the account's, and holds its next
    // request.
    b.advance(100);
    tick(&mut b, &mut svc);
    assert!(!request(&mut b, &mut svc, 2));
    assert_eq!(b.worker.stage(2), Stage::Held);
}
