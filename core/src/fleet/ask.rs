//! One request's admission by the fleet's service, sans-IO: the calls it sends (reservations
//! first, `first_stage`), each answer read as it comes, and the verdict once every call is in
//! (or overdue). What the verdict does to the request is the worker's; what the answers mean
//! is decided here, once, one row of `core/tests/fleet_ask.rs` per case.

use super::calls::Calls;
use super::grpc::{self, ServiceCall, ServiceReply};
use super::limits::{Ask, FleetLimits, Grant, Of};
use super::rls::{self, Code};
use super::turn::{TurnAsk, TurnKey, Turns, TURN_REASK_MS};
use crate::blocked::Blocked;
use crate::config::{Config, LimitKind, OnError};
use crate::effects::TICK_MS;
use crate::env::{Clock, Env};
use crate::metrics::{Counter, Histogram};
use crate::request::{FleetCharge, Flow};
use crate::retry_after::Random;
use crate::store::SharedStore;
use std::sync::atomic::AtomicBool;

/// How soon a request the fleet had no slot for asks again, on average (a slot frees when a
/// stream ends anywhere in the fleet, which only the service sees).
pub const SLOT_REASK_MS: u64 = 50;

/// How long past `fleet.timeout_ms` the worker waits for an answer Envoy never delivered before
/// it applies the fallback itself.
pub const ANSWER_SLACK_MS: u64 = 50;

/// What one answer of admission said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Said {
    Ok { reservation: Option<String> },
    Over { wait_ms: Option<u64> },
    Failed,
}

/// A request's calls to the service, and what each answer said so far.
#[derive(Debug)]
pub struct FleetAsk {
    pool: usize,
    asks: Vec<Ask>,
    /// The seq of the first ask; ask `i` is call `first_seq + i`, whichever stage sent it.
    first_seq: u32,
    /// How many of `asks` were sent: the first stage, then all.
    sent: usize,
    said: Vec<Option<Said>>,
    sent_ms: u64,
    until_ms: u64,
}

/// What an answer leaves the ask waiting for.
#[derive(Debug)]
pub enum Progress {
    /// More answers of this stage are due.
    Waiting,
    /// The first stage admitted: send the rest.
    Send(Vec<ServiceCall>),
    /// Every call is in: the verdict.
    Done(Verdict),
}

/// What the fleet decided for a request.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every fleet limit admits it (or `on_error: allow` let the failed ones pass): it goes.
    Admit(Admitted),
    /// Calls failed and `on_error` is `local`: this Envoy's own buckets of the same rate decide
    /// `limits`; the rest was granted.
    Fallback {
        limits: Vec<usize>,
        granted: Admitted,
    },
    /// A fleet limit refused it (or, `denied`, a call failed under `on_error: deny`), or
    /// another worker of the fleet has its (pool, account)'s turn: it waits or is answered; the
    /// reservations granted are released.
    Refused(Refusal),
}

/// What a request that goes was granted: the token budgets it is charged (settled at its
/// stream's end), and the turn it took, when it asked for one and the service holds it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Admitted {
    pub charges: Vec<FleetCharge>,
    pub turn: Option<Grant>,
    /// How long the turn was taken for.
    pub turn_ms: u64,
}

/// A request the fleet refused: why it waits, whether it may wait at all (a call that failed
/// under `on_error: deny` is answered at once), and the reservations to release.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal {
    pub blocked: Blocked,
    pub denied: bool,
    pub release: Vec<Grant>,
}

impl Verdict {
    /// The verdict carried to its end: what a request that goes was granted, or its refusal.
    /// `fallback` takes the limits this Envoy decides itself (`on_error: local`) from its own
    /// buckets of the same rate.
    pub fn settle(
        self,
        fallback: impl FnOnce(&[usize]) -> Result<(), Blocked>,
    ) -> Result<Admitted, Refusal> {
        match self {
            Verdict::Admit(granted) => Ok(granted),
            Verdict::Fallback { limits, granted } => match fallback(&limits) {
                Ok(()) => Ok(granted),
                Err(blocked) => Err(Refusal {
                    blocked,
                    denied: false,
                    release: granted.into_grants(),
                }),
            },
            Verdict::Refused(refusal) => Err(refusal),
        }
    }
}

impl Admitted {
    /// Every reservation in it, to release.
    fn into_grants(self) -> Vec<Grant> {
        self.turn
            .into_iter()
            .chain(released(self.charges))
            .collect()
    }
}

impl FleetAsk {
    /// What a request admitted here asks the fleet's service, if anything: about its turn
    /// (`turn_ask`), and its fleet limits. Its calls are numbered in `calls`; its hold deadline
    /// is fixed (the stream may be leaving its arrival callback). A turn is taken for
    /// `turn_ms()`.
    pub fn begin(
        fleet: &FleetLimits,
        cfg: &Config,
        calls: &mut Calls,
        turns: &mut Turns,
        flow: &mut Flow,
        (clock, store): (&Clock, &dyn SharedStore),
        turn_ms: impl FnOnce() -> u64,
    ) -> Option<(FleetAsk, Vec<ServiceCall>)> {
        let turn = fleet
            .cooldowns
            .then(|| turn_ask(turns, flow, (clock.now(), store), turn_ms))
            .flatten();
        if fleet.limits().is_empty() && turn.is_none() {
            return None;
        }
        flow.hold.fix(|| clock.now());
        let first_seq = calls.reserve(FleetAsk::calls_of(fleet, turn.is_some()));
        FleetAsk::start(fleet, cfg, flow, turn, first_seq, clock.now())
    }

    /// Whether one of its asks checks the (pool, account)'s cooling marker.
    pub fn peeks(&self) -> bool {
        self.asks.iter().any(|a| a.of == Of::Peek)
    }

    /// Ask the service for every fleet limit of `flow`: the asks numbered from `first_seq`
    /// (the caller reserved `FleetAsk::calls_of(fleet)` numbers), and the first stage's calls.
    pub fn start(
        fleet: &FleetLimits,
        cfg: &Config,
        flow: &Flow,
        turn: Option<TurnAsk>,
        first_seq: u32,
        now: u64,
    ) -> Option<(FleetAsk, Vec<ServiceCall>)> {
        let asks = fleet.asks(cfg, flow, turn);
        if asks.is_empty() {
            return None;
        }
        let mut ask = FleetAsk {
            pool: flow.pool,
            said: vec![None; asks.len()],
            asks,
            first_seq,
            sent: 0,
            sent_ms: 0,
            until_ms: 0,
        };
        let end = first_stage(&ask.asks);
        let calls = ask.send(fleet, cfg, end, now);
        Some((ask, calls))
    }

    /// How many calls admission makes under `fleet`, with the turn or not (the seq numbers to
    /// reserve).
    pub fn calls_of(fleet: &FleetLimits, turn: bool) -> u32 {
        fleet.limits().len() as u32 + u32::from(turn)
    }

    /// When the calls sent are overdue.
    pub fn until_ms(&self) -> u64 {
        self.until_ms
    }

    fn send(
        &mut self,
        fleet: &FleetLimits,
        cfg: &Config,
        end: usize,
        now: u64,
    ) -> Vec<ServiceCall> {
        let calls = (self.sent..end)
            .map(|i| fleet.ask_call(cfg, &self.asks[i], self.first_seq.wrapping_add(i as u32)))
            .collect();
        self.sent = end;
        self.sent_ms = now;
        self.until_ms = now + fleet.timeout_ms + ANSWER_SLACK_MS;
        calls
    }

    /// What became of call `seq`: counted, and the ask's progress. An answer that is not
    /// awaited (not sent, or already in) changes nothing.
    pub fn answer(
        &mut self,
        fleet: &FleetLimits,
        cfg: &Config,
        seq: u32,
        reply: ServiceReply,
        env: &mut Env,
    ) -> Progress {
        let at = seq.wrapping_sub(self.first_seq) as usize;
        if at >= self.sent || self.said[at].is_some() {
            return Progress::Waiting;
        }
        let said = read(&self.asks[at], reply);
        let elapsed = env.now().saturating_sub(self.sent_ms);
        self.count(&said, elapsed, env);
        self.said[at] = Some(said);
        let stage = &self.said[..self.sent];
        if !stage.iter().all(Option::is_some) {
            return Progress::Waiting;
        }
        let refused = stage.iter().any(|s| matches!(s, Some(Said::Over { .. })));
        if self.sent < self.asks.len() && !refused {
            let end = self.asks.len();
            return Progress::Send(self.send(fleet, cfg, end, env.now()));
        }
        Progress::Done(self.verdict(fleet, cfg, env))
    }

    /// An answer (`Some`: of call `seq`, or a failure to send it), or (`None`) the calls still
    /// out overdue.
    pub fn step(
        &mut self,
        fleet: &FleetLimits,
        cfg: &Config,
        answer: Option<(u32, ServiceReply)>,
        env: &mut Env,
    ) -> Progress {
        match answer {
            Some((seq, reply)) => self.answer(fleet, cfg, seq, reply, env),
            None => Progress::Done(self.overdue(fleet, cfg, env)),
        }
    }

    /// The service never answered within its timeout: every call still out failed.
    pub fn overdue(&mut self, fleet: &FleetLimits, cfg: &Config, env: &mut Env) -> Verdict {
        let elapsed = env.now().saturating_sub(self.sent_ms);
        for at in 0..self.sent {
            if self.said[at].is_none() {
                self.count(&Said::Failed, elapsed, env);
                self.said[at] = Some(Said::Failed);
            }
        }
        self.verdict(fleet, cfg, env)
    }

    /// The request is gone before the verdict: the reservations granted so far, to release.
    pub fn abandon(self) -> Vec<Grant> {
        let FleetAsk { asks, said, .. } = self;
        grants(
            asks.into_iter()
                .zip(said.into_iter().map(|s| s.unwrap_or(Said::Failed))),
        )
    }

    /// Every fleet counter is counted here: each call's outcome and how long it took.
    fn count(&self, said: &Said, elapsed: u64, env: &mut Env) {
        env.metrics
            .histogram(self.pool, Histogram::FleetCallMs, elapsed);
        let c = match said {
            Said::Ok { .. } => Counter::FleetCallsOk,
            Said::Over { .. } => Counter::FleetCallsOverLimit,
            Said::Failed => Counter::FleetErrors,
        };
        env.metrics.count(self.pool, c);
    }

    /// The answers as one verdict: a refusal wins (another worker's turn first: the provider
    /// is what waits); failed calls of limits go to `fleet.on_error`. A turn the service could
    /// not give (it failed, or holds none: a server that clamps the hold away) leaves this
    /// Envoy's own cooldown to decide, as without a fleet.
    fn verdict(&mut self, fleet: &FleetLimits, cfg: &Config, env: &mut Env) -> Verdict {
        let said = std::mem::take(&mut self.said);
        let mut answered: Vec<(Ask, Said)> = std::mem::take(&mut self.asks)
            .into_iter()
            .zip(said.into_iter().map(|s| s.unwrap_or(Said::Failed)))
            .collect();
        let default_ms = cfg.retry_after.default_ms;
        let refusal = |blocked, denied, answered| {
            Verdict::Refused(Refusal {
                blocked,
                denied,
                release: grants(answered),
            })
        };
        let turn = answered
            .iter()
            .find(|(a, _)| matches!(a.of, Of::Turn | Of::Peek));
        if let Some((ask, turn)) = turn {
            match turn {
                // Another worker's turn, or (a peek) another Envoy cools it: the request waits.
                Said::Over { .. } => {
                    let retry_in_ms = refusal_wait_ms(None, TURN_REASK_MS, env.rng);
                    return refusal(Blocked::Turn { retry_in_ms }, false, answered);
                }
                Said::Ok { reservation: None } if ask.of == Of::Turn => {
                    env.metrics.count(self.pool, Counter::FleetFallback);
                    warn_unheld_turn();
                }
                Said::Failed => env.metrics.count(self.pool, Counter::FleetFallback),
                Said::Ok { .. } => {}
            }
        }
        // A slot granted without a hold is no slot (a server whose reservation fraction clamps
        // a hold of 1 away): the call failed, `on_error` decides.
        for (a, s) in answered.iter_mut() {
            if let (Of::Limit(l), Said::Ok { reservation: None }) = (a.of, &*s) {
                if cfg.limits[l].kind == LimitKind::InFlight {
                    warn_unheld_slot(&cfg.limits[l].name, cfg.limits[l].per_window);
                    *s = Said::Failed;
                }
            }
        }
        let over = answered.iter().find_map(|(a, s)| match (a.of, s) {
            (Of::Limit(limit), Said::Over { wait_ms }) => Some((limit, *wait_ms)),
            _ => None,
        });
        if let Some((limit, wait_ms)) = over {
            // A full cap frees when a stream of the fleet ends: asked again soon, not at the
            // window's reset.
            let blocked = if cfg.limits[limit].kind == LimitKind::InFlight {
                let retry_in_ms = refusal_wait_ms(None, SLOT_REASK_MS, env.rng);
                Blocked::Slot { limit, retry_in_ms }
            } else {
                let wait_ms = refusal_wait_ms(wait_ms, default_ms, env.rng);
                Blocked::Fleet { limit, wait_ms }
            };
            return refusal(blocked, false, answered);
        }
        let failed: Vec<usize> = answered
            .iter()
            .filter_map(|(a, s)| match (a.of, s) {
                (Of::Limit(limit), Said::Failed) => Some(limit),
                _ => None,
            })
            .collect();
        if !failed.is_empty() {
            env.metrics.count(self.pool, Counter::FleetFallback);
            match fleet.on_error {
                OnError::Allow => {}
                OnError::Deny => {
                    let wait_ms = default_ms;
                    let blocked = Blocked::Fleet {
                        limit: failed[0],
                        wait_ms,
                    };
                    return refusal(blocked, true, answered);
                }
                OnError::Local => {
                    return Verdict::Fallback {
                        limits: failed,
                        granted: admitted(cfg, answered),
                    }
                }
            }
        }
        Verdict::Admit(admitted(cfg, answered))
    }
}

/// What a request asks of its (pool, account)'s turn at `now`: nothing while this worker
/// holds it; to take it (for `turn_ms()`) when the pace of a cooldown released the request;
/// else, when this worker has not looked lately whether the fleet cools it (the first request
/// after a quiet minute: `watch`), a peek; else nothing.
fn turn_ask(
    turns: &mut Turns,
    flow: &Flow,
    (now, store): (u64, &dyn SharedStore),
    turn_ms: impl FnOnce() -> u64,
) -> Option<TurnAsk> {
    let key = TurnKey::of(flow);
    let unseen = turns.watch.sent(key, now, store);
    if turns.holds(key, now) {
        return None;
    }
    if flow.released.is_some() {
        return Some(TurnAsk::Take { ttl_ms: turn_ms() });
    }
    unseen.then_some(TurnAsk::Peek)
}

/// Said once per worker: a server that answers a turn with no hold clamps it away.
fn warn_unheld_turn() {
    static WARNED: AtomicBool = AtomicBool::new(false);
    grpc::warn_once(&WARNED, || {
        "llm_governor: the rate-limit service granted a turn without holding it, so cooldowns \
         stay per Envoy: start limitador-server with --max-reservation-fraction 1 (a turn is \
         the whole of the llm_governor_turn limit, whose max_value is 1)"
            .to_string()
    });
}

/// Said once per worker: a server that answers a slot with no hold clamps it away.
fn warn_unheld_slot(limit: &str, cap: u64) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    grpc::warn_once(&WARNED, || {
        format!(
            "llm_governor: the rate-limit service granted a slot of the fleet max_in_flight \
             {limit:?} without holding it, so fleet.on_error decides each request: start \
             limitador-server with --max-reservation-fraction of at least 1/{cap} (a slot is a \
             hold of 1 of {cap})"
        )
    });
}

/// What the service granted a request that goes: its token budgets and its turn.
fn admitted(cfg: &Config, answered: Vec<(Ask, Said)>) -> Admitted {
    let mut out = Admitted::default();
    for (a, s) in answered {
        match (a.of, s) {
            (
                Of::Turn,
                Said::Ok {
                    reservation: Some(r),
                },
            ) => {
                out.turn_ms = a.ttl_ms;
                out.turn = Some(Grant {
                    of: Of::Turn,
                    key: a.key,
                    reservation: r,
                })
            }
            // Token budgets settle with the usage; a slot is given back at the end.
            (Of::Limit(limit), Said::Ok { reservation })
                if cfg.limits[limit].kind != LimitKind::Requests =>
            {
                // A slot is one hold of its cap and its guard.
                let slot = cfg.limits[limit].kind == LimitKind::InFlight;
                out.charges.push(FleetCharge {
                    limit,
                    key: a.key,
                    amount: a.amount,
                    guard: reservation.clone().filter(|_| slot),
                    reservation,
                    unguarded: false,
                    settled: None,
                    renew_at_ms: None,
                })
            }
            _ => {}
        }
    }
    out
}

/// The reservations the service granted.
fn grants(answered: impl IntoIterator<Item = (Ask, Said)>) -> Vec<Grant> {
    answered
        .into_iter()
        .filter_map(|(a, s)| match s {
            Said::Ok {
                reservation: Some(r),
            } => Some(Grant {
                of: a.of,
                key: a.key,
                reservation: r,
            }),
            _ => None,
        })
        .collect()
}

/// The reservations among `charges` (what a refused request gives back).
fn released(charges: Vec<FleetCharge>) -> Vec<Grant> {
    charges
        .into_iter()
        .filter_map(|c| {
            Some(Grant {
                of: Of::Limit(c.limit),
                key: c.key,
                reservation: c.reservation?,
            })
        })
        .collect()
}

/// What an answer to `ask` says; a message that cannot be read, or a code that is neither OK
/// nor OVER_LIMIT, is a failure (the fallback decides).
fn read(ask: &Ask, reply: ServiceReply) -> Said {
    let bytes = match reply {
        ServiceReply::Message(bytes) => bytes,
        ServiceReply::Failed(code) => {
            if ask.reserve {
                grpc::warn_if_no_reservations(code);
            } else if ask.of == Of::Peek {
                grpc::warn_if_no_check(code);
            }
            return Said::Failed;
        }
    };
    let answer = if ask.reserve {
        rls::decode_reserve(bytes)
    } else {
        rls::decode_response(bytes)
    };
    match answer {
        Ok(a) if a.code == Some(Code::Ok) => Said::Ok {
            reservation: a.reservation.filter(|r| !r.is_empty()),
        },
        Ok(a) if a.code == Some(Code::OverLimit) => Said::Over { wait_ms: a.wait_ms },
        _ => Said::Failed,
    }
}

/// How many of a request's `asks` (a turn or a peek, then token budgets) go out first.
/// Reservations and a peek go first when other asks follow: a peek counts nothing, a refusal
/// gives a reservation back at no cost (a Commit of 0), where
/// a hit `ShouldRateLimit` counted (or a token charge) is never given back. So the rest are
/// asked only once no reservation was refused: a request the token budget turns away, and
/// every ask again of a held one, costs the request budget nothing. All at once when nothing
/// reserves, or everything does.
fn first_stage(asks: &[Ask]) -> usize {
    match asks
        .iter()
        .take_while(|a| a.reserve || a.of == Of::Peek)
        .count()
    {
        0 => asks.len(),
        n => n,
    }
}

/// The wait of a fleet refusal: the service's reset, or `default_ms` when it reports none.
/// Limitador reports its reset in whole seconds rounded down, so in a window's last second it
/// says 0; a wait under a tick is drawn from [that wait or 1, 2 ticks) instead. A held request
/// then asks about once a tick, not as fast as the service answers (the native host has no
/// tick to round a 1 ms wait up), and requests refused together do not ask again together,
/// where checks that overlap could each pass (README, "Overshoot").
pub fn refusal_wait_ms(reported_ms: Option<u64>, default_ms: u64, rng: &mut dyn Random) -> u64 {
    let ms = reported_ms.unwrap_or(default_ms);
    if ms >= TICK_MS {
        return ms;
    }
    let low = ms.max(1);
    low + (rng.unit().clamp(0.0, 1.0) * (2 * TICK_MS - low) as f64) as u64
}
