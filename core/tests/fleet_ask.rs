//! What the fleet's answers mean for one request's admission (`fleet::ask`), one row per
//! (answers, `on_error`) → verdict: the calls of each stage, a refusal's wait, what the
//! fallback decides, and which reservations a refused request releases.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use llm_governor_core::blocked::Blocked;
use llm_governor_core::effects::TICK_MS;
use llm_governor_core::fleet::ask::{Admitted, FleetAsk, Progress, Refusal, Verdict};
use llm_governor_core::fleet::grpc::{Method, ServiceReply, NOT_SENT};
use llm_governor_core::fleet::limits::{Grant, Of};
use llm_governor_core::fleet::turn::{TurnAsk, TURN_MS};
use llm_governor_core::headers::owned;
use llm_governor_core::metrics::Counter;
use llm_governor_core::policy::Clock;
use llm_governor_core::request::FleetCharge;

/// A reserving token budget (limit 0) and a request limit (limit 1), both the fleet's.
fn config(on_error: &str) -> String {
    format!(
        r#"{{"fleet": {{"cluster": "rls", "timeout_ms": 50, "on_error": "{on_error}"}},
  "pools": [{{"name": "openai", "match": {{"path_prefix": "/v1/chat"}}, "dialect": "openai"}}],
  "limits": [
    {{"name": "tpm", "key": "header:x-tenant-id", "tokens_per_minute": 100000, "scope": "fleet"}},
    {{"name": "rpm", "key": "header:x-tenant-id", "requests_per_minute": 10, "scope": "fleet"}}]}}"#
    )
}

/// The request limit alone.
fn rpm_only(on_error: &str) -> String {
    format!(
        r#"{{"fleet": {{"cluster": "rls", "timeout_ms": 50, "on_error": "{on_error}"}},
  "limits": [{{"name": "rpm", "key": "header:x-tenant-id", "requests_per_minute": 10, "scope": "fleet"}}]}}"#
    )
}

const BODY: &str =
    r#"{"model":"gpt-4o-mini","max_tokens":100,"messages":[{"role":"user","content":"hello"}]}"#;

/// What the service does with one call.
#[derive(Clone, Copy)]
enum Says {
    Ok,
    /// OK with this reservation id.
    Reserved(&'static str),
    /// OVER_LIMIT, with a reset in seconds.
    Over(Option<u64>),
    /// The call failed (gRPC status).
    Fails(u32),
    /// A message that is no answer at all.
    Garbage,
    /// No answer before the deadline.
    Silent,
}

/// Ask for a request of tenant `acme` under `cfg`, the service answering each call in order as
/// `says` does; the methods of each stage's calls and the verdict.
fn run(cfg: &str, says: &[Says]) -> (Vec<Vec<Method>>, Verdict, Host) {
    run_asking(cfg, None, says)
}

/// `run`, the request also asking about its (pool, account)'s turn (`Take`: the pace of a
/// cooldown released it; `Peek`: the worker has not looked whether the fleet cools it).
fn run_asking(
    cfg: &str,
    turn: Option<TurnAsk>,
    says: &[Says],
) -> (Vec<Vec<Method>>, Verdict, Host) {
    let mut host = Host::new(cfg);
    let hs = owned(&[("x-tenant-id", "acme")]);
    let gov = host.worker.governor();
    let fleet = gov.fleet().expect("fleet limits").clone();
    let mut flow = gov.pools().flow_for(&view("/v1/chat/completions", &hs));
    gov.pools()
        .on_request_body(&mut flow, BODY.as_bytes(), BODY.len());
    let cfg = gov.cfg.clone();
    let (mut ask, first) = FleetAsk::start(&fleet, &cfg, &flow, turn, 100, T0).expect("asks");
    let mut stages = vec![first.iter().map(|c| c.method).collect::<Vec<_>>()];
    let mut pending: Vec<_> = first;
    let mut says = says.iter();
    while let Some(call) = pending.first().cloned() {
        pending.remove(0);
        let said = *says.next().expect("an answer for every call");
        let bytes = match said {
            Says::Ok => rls_answer(1, None),
            Says::Reserved(id) => reserve_answer(1, id),
            Says::Over(reset) if call.method == Method::Reserve => {
                let _ = reset;
                reserve_answer(2, "")
            }
            Says::Over(reset) => rls_answer(2, reset),
            Says::Garbage => vec![0xff, 0xff, 0xff],
            Says::Fails(_) | Says::Silent => Vec::new(),
        };
        let reply = match said {
            Says::Fails(code) => ServiceReply::Failed(code),
            _ => ServiceReply::Message(&bytes),
        };
        host.advance(3);
        let now = host.now_ms;
        let (_, mut env) = host.parts_with(Clock::At(now));
        if let Says::Silent = said {
            host.advance(50 + llm_governor_core::fleet::ask::ANSWER_SLACK_MS);
            let now = host.now_ms;
            let (_, mut env) = host.parts_with(Clock::At(now));
            let verdict = ask.overdue(&fleet, &cfg, &mut env);
            return (stages, verdict, host);
        }
        match ask.answer(&fleet, &cfg, call.seq, reply, &mut env) {
            Progress::Waiting => {}
            Progress::Send(calls) => {
                stages.push(calls.iter().map(|c| c.method).collect());
                pending.extend(calls);
            }
            Progress::Done(verdict) => return (stages, verdict, host),
        }
    }
    panic!("no verdict after every call was answered");
}

fn charge(reservation: Option<&str>) -> FleetCharge {
    FleetCharge {
        renew_at_ms: None,
        limit: 0,
        key: "acme".into(),
        amount: 0, // compared without the amount: see `shape`
        reservation: reservation.map(str::to_string),
        guard: None,
        unguarded: false,
        settled: None,
    }
}

/// A verdict as a row compares it: charges without their amounts (the estimate's size is not
/// what a row tests), a turn's random re-ask without its value.
fn shape(v: Verdict) -> Verdict {
    let granted = |a: Admitted| Admitted {
        charges: a
            .charges
            .into_iter()
            .map(|c| FleetCharge { amount: 0, ..c })
            .collect(),
        ..a
    };
    match v {
        Verdict::Admit(a) => Verdict::Admit(granted(a)),
        Verdict::Fallback { limits, granted: a } => Verdict::Fallback {
            limits,
            granted: granted(a),
        },
        Verdict::Refused(Refusal {
            blocked: Blocked::Turn { .. },
            denied,
            release,
        }) => Verdict::Refused(Refusal {
            blocked: Blocked::Turn { retry_in_ms: 0 },
            denied,
            release,
        }),
        v => v,
    }
}

fn admit(charges: Vec<FleetCharge>) -> Verdict {
    Verdict::Admit(Admitted {
        charges,
        ..Admitted::default()
    })
}

fn fallback(limits: Vec<usize>, charges: Vec<FleetCharge>) -> Verdict {
    Verdict::Fallback {
        limits,
        granted: Admitted {
            charges,
            ..Admitted::default()
        },
    }
}

fn refused(blocked: Blocked, denied: bool, release: Vec<Grant>) -> Verdict {
    Verdict::Refused(Refusal {
        blocked,
        denied,
        release,
    })
}

fn over(limit: usize, wait_ms: u64) -> Blocked {
    Blocked::Fleet { limit, wait_ms }
}

fn release(id: &str) -> Grant {
    Grant {
        of: Of::Limit(0),
        key: "acme".into(),
        reservation: id.into(),
    }
}

fn turn(id: &str) -> Grant {
    Grant {
        of: Of::Turn,
        key: "default/0000000000000000".into(),
        reservation: id.into(),
    }
}

use Method::{Reserve, ShouldRateLimit as Srl};

#[test]
fn every_combination_of_answers_and_on_error_has_one_verdict() {
    // (what the row proves, the configuration, the answers, each stage's calls, the verdict)
    type Row = (&'static str, String, Vec<Says>, Vec<Vec<Method>>, Verdict);
    #[rustfmt::skip]
    let rows: Vec<Row> = vec![
        ("one limit admits",
         rpm_only("local"), vec![Says::Ok], vec![vec![Srl]], admit(vec![])),
        ("one limit refuses: its reset is the wait",
         rpm_only("local"), vec![Says::Over(Some(3))], vec![vec![Srl]], refused(over(0, 3000), false, vec![])),
        ("a refusal with no reset waits the default",
         rpm_only("local"), vec![Says::Over(None)], vec![vec![Srl]], refused(over(0, 1000), false, vec![])),
        ("a failed call under local: this Envoy's bucket decides",
         rpm_only("local"), vec![Says::Fails(14)], vec![vec![Srl]], fallback(vec![0], vec![])),
        ("a failed call under allow: it goes",
         rpm_only("allow"), vec![Says::Fails(14)], vec![vec![Srl]], admit(vec![])),
        ("a failed call under deny: refused at once, the default wait",
         rpm_only("deny"), vec![Says::Fails(14)], vec![vec![Srl]], refused(over(0, 1000), true, vec![])),
        ("an unreadable answer is a failed call",
         rpm_only("deny"), vec![Says::Garbage], vec![vec![Srl]], refused(over(0, 1000), true, vec![])),
        ("a call that could not be sent is a failed call",
         rpm_only("local"), vec![Says::Fails(NOT_SENT)], vec![vec![Srl]], fallback(vec![0], vec![])),
        ("no answer before the deadline is a failed call",
         rpm_only("local"), vec![Says::Silent], vec![vec![Srl]], fallback(vec![0], vec![])),
        ("the reservation first, then the rest: both admit",
         config("local"), vec![Says::Reserved("r-1"), Says::Ok], vec![vec![Reserve], vec![Srl]],
         admit(vec![charge(Some("r-1"))])),
        ("a refused reservation: the rest are never asked",
         config("local"), vec![Says::Over(None)], vec![vec![Reserve]], refused(over(0, 1000), false, vec![])),
        ("the request limit refuses: the reservation is released",
         config("local"), vec![Says::Reserved("r-1"), Says::Over(Some(2))], vec![vec![Reserve], vec![Srl]],
         refused(over(1, 2000), false, vec![release("r-1")])),
        ("a failed reservation under local: the rest are asked, the fallback decides the budget",
         config("local"), vec![Says::Fails(14), Says::Ok], vec![vec![Reserve], vec![Srl]],
         fallback(vec![0], vec![])),
        ("a failed request call under deny: the reservation is released",
         config("deny"), vec![Says::Reserved("r-1"), Says::Fails(4)], vec![vec![Reserve], vec![Srl]],
         refused(over(1, 1000), true, vec![release("r-1")])),
        ("a failed request call under allow: it goes, charged its reservation",
         config("allow"), vec![Says::Reserved("r-1"), Says::Fails(4)], vec![vec![Reserve], vec![Srl]],
         admit(vec![charge(Some("r-1"))])),
        ("a failed request call under local: the fallback decides it, the reservation stands",
         config("local"), vec![Says::Reserved("r-1"), Says::Fails(4)], vec![vec![Reserve], vec![Srl]],
         fallback(vec![1], vec![charge(Some("r-1"))])),
        ("an OK without a reservation id charges with none",
         config("local"), vec![Says::Reserved(""), Says::Ok], vec![vec![Reserve], vec![Srl]],
         admit(vec![charge(None)])),
    ];
    for (name, cfg, says, want_stages, want) in rows {
        let (stages, verdict, _) = run(&cfg, &says);
        assert_eq!(stages, want_stages, "{name}: the calls of each stage");
        assert_eq!(shape(verdict), want, "{name}");
    }
}

/// A row: its name, the config, what the service says, the calls of each stage, the verdict.
type Row = (&'static str, String, Vec<Says>, Vec<Vec<Method>>, Verdict);

/// `rpm_only` with the fleet's cooldowns shared.
fn cooled(on_error: &str) -> String {
    rpm_only(on_error).replace(
        "\"timeout_ms\": 50,",
        "\"timeout_ms\": 50, \"cooldowns\": true,",
    )
}

#[test]
fn a_cooldowns_release_asks_the_turn_first_and_only_one_worker_of_the_fleet_has_it() {
    #[rustfmt::skip]
    let rows: Vec<Row> = vec![
        ("the turn is granted: it goes, and the worker keeps the turn",
         cooled("local"), vec![Says::Reserved("t-1"), Says::Ok], vec![vec![Reserve], vec![Srl]],
         Verdict::Admit(Admitted { charges: vec![], turn: Some(turn("t-1")), turn_ms: TURN_MS })),
        ("another worker has the turn: it waits for it, the rest is never asked",
         cooled("local"), vec![Says::Over(None)], vec![vec![Reserve]],
         refused(Blocked::Turn { retry_in_ms: 0 }, false, vec![])),
        ("a limit refuses a request that has the turn: the turn is released with the rest",
         cooled("local"), vec![Says::Reserved("t-1"), Says::Over(Some(2))], vec![vec![Reserve], vec![Srl]],
         refused(over(0, 2000), false, vec![turn("t-1")])),
        ("the service cannot give the turn: this Envoy's own cooldown decides, as without a fleet",
         cooled("deny"), vec![Says::Fails(14), Says::Ok], vec![vec![Reserve], vec![Srl]], admit(vec![])),
        ("a turn granted without a hold (a server that clamps it away): as above",
         cooled("deny"), vec![Says::Reserved(""), Says::Ok], vec![vec![Reserve], vec![Srl]], admit(vec![])),
    ];
    for (name, cfg, says, want_stages, want) in rows {
        let (stages, verdict, _) = run_asking(&cfg, Some(TAKE), &says);
        assert_eq!(stages, want_stages, "{name}: the calls of each stage");
        assert_eq!(shape(verdict), want, "{name}");
    }
    // Shared cooldowns alone (no fleet limit): only the turn is asked.
    let alone = r#"{"fleet": {"cluster": "rls", "timeout_ms": 50, "cooldowns": true}}"#;
    let (stages, verdict, _) = run_asking(alone, Some(TAKE), &[Says::Reserved("t-2")]);
    assert_eq!(stages, vec![vec![Reserve]]);
    assert_eq!(
        verdict,
        Verdict::Admit(Admitted {
            charges: vec![],
            turn_ms: TURN_MS,
            turn: Some(Grant {
                of: Of::Turn,
                key: "default/0000000000000000".into(),
                reservation: "t-2".into()
            })
        })
    );
}

const TAKE: TurnAsk = TurnAsk::Take { ttl_ms: TURN_MS };

#[test]
fn a_peek_at_the_fleets_cooling_marker_holds_the_request_when_another_envoy_cools_it() {
    use Method::CheckRateLimit as Check;
    #[rustfmt::skip]
    let rows: Vec<Row> = vec![
        ("nothing cools it: it goes, with no turn",
         cooled("local"), vec![Says::Ok, Says::Ok], vec![vec![Check], vec![Srl]], admit(vec![])),
        ("another Envoy cools it: it waits for the turn, its limits never asked (nothing counted)",
         cooled("local"), vec![Says::Over(None)], vec![vec![Check]],
         refused(Blocked::Turn { retry_in_ms: 0 }, false, vec![])),
        ("the check fails: this Envoy's own cooldown decides, as without a fleet",
         cooled("deny"), vec![Says::Fails(14), Says::Ok], vec![vec![Check], vec![Srl]], admit(vec![])),
        ("an answer that cannot be read: as above",
         cooled("deny"), vec![Says::Garbage, Says::Ok], vec![vec![Check], vec![Srl]], admit(vec![])),
    ];
    for (name, cfg, says, want_stages, want) in rows {
        let (stages, verdict, _) = run_asking(&cfg, Some(TurnAsk::Peek), &says);
        assert_eq!(stages, want_stages, "{name}: the calls of each stage");
        assert_eq!(shape(verdict), want, "{name}");
    }
}

#[test]
fn a_refusal_in_a_windows_last_second_asks_again_within_two_ticks() {
    // Limitador says 0 s in a window's last second: the wait is drawn from [1, 2 ticks).
    let (_, verdict, _) = run(&rpm_only("local"), &[Says::Over(Some(0))]);
    let Verdict::Refused(Refusal {
        blocked: Blocked::Fleet { wait_ms, .. },
        ..
    }) = verdict
    else {
        panic!("refused, got {verdict:?}");
    };
    assert!((1..2 * TICK_MS).contains(&wait_ms), "{wait_ms}");
}

#[test]
fn every_call_is_counted_with_its_latency_once() {
    // Answered and timed-out calls alike: one outcome counter and one latency sample each.
    let (_, _, host) = run(
        &config("local"),
        &[Says::Reserved("r-1"), Says::Over(Some(1))],
    );
    let count = |c| {
        host.metrics
            .counters
            .iter()
            .filter(|(_, x)| *x == c)
            .count()
    };
    assert_eq!(count(Counter::FleetCallsOk), 1);
    assert_eq!(count(Counter::FleetCallsOverLimit), 1);
    let samples = |h: &Host| h.metrics.fleet_call_ms.len();
    assert_eq!(samples(&host), 2);
    let (_, _, host) = run(&rpm_only("local"), &[Says::Silent]);
    let count = |c| {
        host.metrics
            .counters
            .iter()
            .filter(|(_, x)| *x == c)
            .count()
    };
    assert_eq!(count(Counter::FleetErrors), 1);
    assert_eq!(count(Counter::FleetFallback), 1);
    assert_eq!(
        samples(&host),
        1,
        "a timed-out call has its latency sample too"
    );
}
