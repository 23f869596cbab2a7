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
use llm_governor_core::metrics::Counter;
use llm_governor_core::worker::Stage;

const CFG: &str = r#"{"fleet": {"cluster": "rls", "timeout_ms": 50, "cooldowns": true}, "hold": {"max_ms": 10000}}"#;

/// The service's limit `llm_governor_turn`: one hold at a time, until its ttl.
#[derive(Default)]
struct TurnService {
    holder: Option<(String, u64)>,
    issued: u32,
    down: bool,
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
            Method::ShouldRateLimit => rls_answer(1, None),
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

/// Send the calls a host owes the service (commits, a turn given back) and answer them.
fn pump_owed(h: &mut Host, svc: &mut TurnService) {
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

/// Three Envoys that each met the provider's 429 (`retry-after: 1`) and hold a request of the
/// account (stream 2) through it.
fn cooled_fleet() -> Vec<Host> {
    let mut fleet: Vec<Host> = (0..3).map(|_| Host::new(CFG)).collect();
    for h in &mut fleet {
        let first = h.forward(PATH, &[A]);
        h.respond(&first, 429, &[("retry-after", "1")], RL);
        h.end(&first);
        assert!(matches!(h.arrive(2, PATH, &[A]), Step::Held));
    }
    fleet
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
    let mut fleet = cooled_fleet();
    // The cooldown ends on every Envoy: each asks for the turn; only the first gets it.
    let went = round(&mut fleet, 1_000 + 1, &mut svc);
    assert_eq!(
        went,
        vec![vec![2], vec![], vec![]],
        "one probe for the fleet"
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
    let went = round(&mut fleet, 500, &mut svc);
    assert_eq!(
        went,
        vec![Vec::<u32>::new(), vec![], vec![]],
        "nobody probes mid-cooldown"
    );
    let went = round(&mut fleet, 600, &mut svc);
    assert_eq!(
        went,
        vec![vec![3], vec![], vec![]],
        "the next round's one probe is the holder's"
    );
    // The provider recovered: the probe succeeds with room. The holder has nothing more to
    // send: it gives the turn back, and the next Envoy's request goes.
    let room = [
        ("x-ratelimit-remaining-requests", "9"),
        ("x-ratelimit-limit-requests", "10"),
    ];
    fleet[0].respond(3, 200, &room, "{}");
    assert_eq!(tick(&mut fleet[0], &mut svc), Vec::<u32>::new());
    assert!(svc.holder.is_none(), "the turn was given back");
    fleet[1].advance(60);
    assert_eq!(tick(&mut fleet[1], &mut svc), vec![2]);
    fleet[2].advance(60);
    assert_eq!(
        tick(&mut fleet[2], &mut svc),
        Vec::<u32>::new(),
        "one Envoy at a time"
    );
}

#[test]
fn with_the_service_down_each_envoy_keeps_its_own_cooldown_and_says_so() {
    let mut svc = TurnService {
        down: true,
        ..TurnService::default()
    };
    let mut fleet = cooled_fleet();
    let went = round(&mut fleet, 1_000 + 1, &mut svc);
    assert_eq!(
        went,
        vec![vec![2], vec![2], vec![2]],
        "one probe per Envoy, as without a fleet"
    );
    for h in &fleet {
        assert_eq!(h.metrics.count_of(0, Counter::FleetFallback), 1);
        assert_eq!(h.metrics.count_of(0, Counter::FleetErrors), 1);
    }
}

#[test]
fn nothing_is_asked_while_nothing_is_cooling() {
    let mut h = Host::new(CFG);
    for id in 10..20 {
        let r = h.request_headers(id, &[A], true);
        assert_eq!(r.action, Action::Continue, "{r:?}");
        assert!(!r
            .effects
            .iter()
            .any(|e| matches!(e, Effect::CallService(_))));
    }
}
