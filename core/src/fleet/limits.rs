//! The fleet limits of a configuration (`limits[].scope: "fleet"`), its shared cooldowns
//! (`fleet.cooldowns`, `turn`) and the service's settings, built once at load: what admission
//! asks the service for a request (one call per fleet limit, and the (pool, account)'s turn when
//! a cooldown's pace released it; each with the one descriptor an operator's limits file
//! matches: `descriptors[0]['limit']`, `descriptors[0]['key']`), and what a stream owes it at
//! its end.

use super::grpc::{Method, ServiceCall};
use super::rls::{self, Descriptor, Names};
use super::turn::{TurnAsk, TurnKey, COOLING_LIMIT, TURN_LIMIT};
use crate::config::{Config, LimitKey, LimitKind, OnError, Scope};
use crate::headers::Headers;
use crate::keys;
use crate::limits;
use crate::request::{FleetCharge, Flow};

/// How long the service holds a token reservation for a stream that never commits (Limitador
/// caps it at its `--max-reservation-ttl`, 60 s by default).
pub const RESERVATION_TTL_MS: u64 = 60_000;
/// A key value longer than this goes to the service as its keyed id.
const MAX_KEY_VALUE: usize = 256;

/// The fleet limits and how to reach the service that decides them.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetLimits {
    /// The fleet limits, by index: token budgets, then `max_in_flight` caps, then request
    /// rates (what is reserved first: a reservation the service holds can be released at no
    /// cost if another limit refuses).
    limits: Vec<usize>,
    domain: String,
    pub(crate) timeout_ms: u64,
    pub(crate) on_error: OnError,
    /// Token budgets reserve (Reserve / Commit); false: charged at admission, topped up after.
    reservations: bool,
    /// Cooldowns are the fleet's: a released request needs its (pool, account)'s turn.
    pub(crate) cooldowns: bool,
}

/// What one call of the service is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Of {
    /// A fleet limit, by index.
    Limit(usize),
    /// The turn of a (pool, account): the right to release what its cooldown's pace lets go.
    Turn,
    /// Whether a (pool, account) cools somewhere in the fleet: a check that counts nothing.
    Peek,
}

/// One call of a request's admission: what it is about, the descriptor's key, how much.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) of: Of,
    pub(crate) key: String,
    /// Requests and turns: 1. Tokens: the reservation (at least 1: a budget with nothing left
    /// refuses).
    pub(crate) amount: u64,
    pub(crate) reserve: bool,
    /// How long a reservation holds (a turn's: how long it is taken for).
    pub(crate) ttl_ms: u64,
}

/// A reservation the service granted a request: released (a Commit of 0) when the request
/// does not go on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub of: Of,
    pub key: String,
    pub reservation: String,
}

impl FleetLimits {
    /// The fleet limits and shared cooldowns of `cfg`; None when it has neither (then nothing
    /// is ever asked).
    pub fn of(cfg: &Config) -> Option<FleetLimits> {
        let fleet = cfg.fleet.as_ref()?;
        let ls = &cfg.limits;
        let rank = |k: LimitKind| match k {
            LimitKind::Tokens => 0,
            LimitKind::InFlight => 1,
            LimitKind::Requests => 2,
        };
        let mut limits: Vec<usize> = (0..ls.len())
            .filter(|&i| ls[i].scope == Scope::Fleet)
            .collect();
        limits.sort_by_key(|&i| rank(ls[i].kind));
        for &i in &limits {
            let l = &ls[i];
            if l.kind == LimitKind::InFlight && l.slot_lease_ms > RESERVATION_TTL_MS {
                // Nothing in the protocol says what TTL a hold got: said at load.
                log::warn!(
                    "llm_governor: limits[{i}] ({:?}) leases fleet slots for {} ms; \
                     limitador-server cuts a hold at --max-reservation-ttl (60 s by default): \
                     start it with --max-reservation-ttl of at least that, or a stream past \
                     60 s stops holding its slot",
                    l.name,
                    l.slot_lease_ms
                );
            }
        }
        (!limits.is_empty() || fleet.cooldowns).then(|| FleetLimits {
            limits,
            domain: fleet.domain.clone(),
            timeout_ms: fleet.timeout_ms,
            on_error: fleet.on_error,
            reservations: fleet.reservations,
            cooldowns: fleet.cooldowns,
        })
    }

    /// The fleet limits, by index (token budgets first, then caps).
    pub fn limits(&self) -> &[usize] {
        &self.limits
    }

    /// What admission asks the service for this flow: its turn when it needs one (the pace of
    /// a cooldown released it), or whether the fleet cools its (pool, account) (this worker
    /// has not looked lately); then one call per fleet limit.
    pub(crate) fn asks(&self, cfg: &Config, flow: &Flow, turn: Option<TurnAsk>) -> Vec<Ask> {
        let turn = turn.map(|t| {
            let (of, reserve, ttl_ms) = match t {
                TurnAsk::Take { ttl_ms } => (Of::Turn, true, ttl_ms),
                TurnAsk::Peek => (Of::Peek, false, 0),
            };
            let key = TurnKey::of(flow).descriptor_key(cfg);
            Ask {
                of,
                key,
                amount: 1,
                reserve,
                ttl_ms,
            }
        });
        turn.into_iter()
            .chain(self.limits.iter().map(|&i| {
                let l = &cfg.limits[i];
                let (amount, reserve, ttl_ms) = match l.kind {
                    LimitKind::Tokens => (
                        limits::reservation(l, flow).amount.max(1),
                        self.reservations,
                        RESERVATION_TTL_MS,
                    ),
                    // A slot: a hold of 1 for the lease, given back (a Commit of 0) when the
                    // stream ends however it ends.
                    LimitKind::InFlight => (1, true, l.slot_lease_ms),
                    LimitKind::Requests => (1, false, RESERVATION_TTL_MS),
                };
                Ask {
                    of: Of::Limit(i),
                    key: self.key(cfg, i, flow),
                    amount,
                    reserve,
                    ttl_ms,
                }
            }))
            .collect()
    }

    /// The call of one ask of admission.
    pub(crate) fn ask_call(&self, cfg: &Config, ask: &Ask, seq: u32) -> ServiceCall {
        let d = [descriptor(cfg, ask.of, ask.key.clone())];
        if ask.reserve {
            let message = rls::reserve(&self.domain, &d, ask.amount, ask.ttl_ms);
            return self.call(seq, Method::Reserve, message);
        }
        let hits = u32::try_from(ask.amount).unwrap_or(u32::MAX);
        let message = rls::should_rate_limit(&self.domain, &d, hits);
        let method = match ask.of {
            Of::Peek => Method::CheckRateLimit,
            Of::Limit(_) | Of::Turn => Method::ShouldRateLimit,
        };
        self.call(seq, method, message)
    }

    /// Whether `key` (a turn's key) cools somewhere in the fleet: a check of one hit on
    /// `COOLING_LIMIT` that counts nothing (over its limit: some Envoy cools it).
    pub(crate) fn peek_call(&self, key: String, seq: u32) -> ServiceCall {
        let d = [descriptor_of(COOLING_LIMIT, key)];
        let message = rls::should_rate_limit(&self.domain, &d, 1);
        self.call(seq, Method::CheckRateLimit, message)
    }

    /// `key` cools here: a hit on `COOLING_LIMIT` (its window short, hit again while it cools),
    /// so every other Envoy's check of it is over its limit.
    pub(crate) fn mark_call(&self, key: String, seq: u32) -> ServiceCall {
        let d = [descriptor_of(COOLING_LIMIT, key)];
        let message = rls::should_rate_limit(&self.domain, &d, 1);
        self.call(seq, Method::ShouldRateLimit, message)
    }

    /// The call a charge owes the service when its stream ends: a Commit of what the stream
    /// used (what was reserved when that is unknown); without reservations, a top-up of what
    /// it used beyond the charge, never a refund.
    pub(crate) fn settle_call(
        &self,
        cfg: &Config,
        charge: &FleetCharge,
        seq: u32,
    ) -> Option<ServiceCall> {
        let d = [descriptor(cfg, Of::Limit(charge.limit), charge.key.clone())];
        let used = charge.settled.unwrap_or(charge.amount);
        if self.reservations {
            let id = charge.reservation.as_deref().unwrap_or("");
            return Some(self.call(seq, Method::Commit, rls::commit(&self.domain, &d, id, used)));
        }
        let more = used.checked_sub(charge.amount).filter(|n| *n > 0)?;
        let hits = u32::try_from(more).unwrap_or(u32::MAX);
        let message = rls::should_rate_limit(&self.domain, &d, hits);
        Some(self.call(seq, Method::ShouldRateLimit, message))
    }

    /// A reservation the request will not use (another limit refused it): released at no cost.
    pub(crate) fn release_call(&self, cfg: &Config, grant: &Grant, seq: u32) -> ServiceCall {
        let d = [descriptor(cfg, grant.of, grant.key.clone())];
        let message = rls::commit(&self.domain, &d, &grant.reservation, 0);
        self.call(seq, Method::Commit, message)
    }

    /// One hold of a fleet slot of `limit` (keyed `key`) taken again for its lease (`slots`):
    /// a Reserve of 1 on its cap or its guard, as admission asks both.
    pub(crate) fn slot_call(
        &self,
        cfg: &Config,
        (limit, key, part): (usize, String, Names),
        seq: u32,
    ) -> ServiceCall {
        let d = [slot_descriptor(cfg, limit, key, part)];
        let lease_ms = cfg.limits[limit].slot_lease_ms;
        let message = rls::reserve(&self.domain, &d, 1, lease_ms);
        self.call(seq, Method::Reserve, message)
    }

    /// A hold `reservation` of a fleet slot given back (a Commit of 0) on its cap, its guard
    /// or both (`slots`).
    pub(crate) fn slot_release(
        &self,
        cfg: &Config,
        (limit, key, part): (usize, String, Names),
        reservation: &str,
        seq: u32,
    ) -> ServiceCall {
        let d = [slot_descriptor(cfg, limit, key, part)];
        let message = rls::commit(&self.domain, &d, reservation, 0);
        self.call(seq, Method::Commit, message)
    }

    /// A turn taken (or taken again) for `ttl_ms`.
    pub(crate) fn turn_call(&self, key: String, ttl_ms: u64, seq: u32) -> ServiceCall {
        let d = [descriptor_of(TURN_LIMIT, key)];
        let message = rls::reserve(&self.domain, &d, 1, ttl_ms);
        self.call(seq, Method::Reserve, message)
    }

    fn call(&self, seq: u32, method: Method, message: Vec<u8>) -> ServiceCall {
        ServiceCall {
            seq,
            method,
            message,
            timeout_ms: self.timeout_ms,
        }
    }

    /// The descriptor's `key` for limit `limit`: the header's value, the model, the pool's name,
    /// the pool's account label; a credential (an account, or a header that is one of
    /// `account_headers`) only ever as its keyed id.
    fn key(&self, cfg: &Config, limit: usize, flow: &Flow) -> String {
        let raw = || {
            let keys = flow.fleet.as_ref()?;
            keys.keys
                .iter()
                .find(|(i, _)| *i == limit)
                .map(|(_, v)| v.clone())
        };
        match &cfg.limits[limit].key {
            LimitKey::Pool => cfg.pools[flow.pool].name.clone(),
            LimitKey::Account => match &cfg.pools[flow.pool].account {
                Some(label) => label.clone(),
                None => keys::id_hex(flow.account),
            },
            LimitKey::Header(_) | LimitKey::Model { .. } => {
                raw().unwrap_or_else(|| keys::id_hex(flow.limit_keys[limit]))
            }
        }
    }

    /// The raw key values of the fleet limits keyed by a header that is not a credential, or
    /// by a model named in the path, read from the request headers once.
    pub(crate) fn keys_of(
        &self,
        cfg: &Config,
        path: &[u8],
        headers: &Headers,
    ) -> Vec<(usize, String)> {
        let model = || keys::model_in_path(path).unwrap_or(b"-");
        self.limits
            .iter()
            .filter_map(|&i| {
                let value = match &cfg.limits[i].key {
                    LimitKey::Header(h) => plain_header(cfg, h, headers)?.to_vec(),
                    LimitKey::Model { header: None } => model().to_vec(),
                    LimitKey::Model { header: Some(h) } => {
                        let mut v = plain_header(cfg, h, headers)?.to_vec();
                        v.push(b'+');
                        v.extend_from_slice(model());
                        v
                    }
                    LimitKey::Pool | LimitKey::Account => return None,
                };
                key_value(&value).map(|v| (i, v))
            })
            .collect()
    }

    /// The model the body named, for fleet limits keyed by model whose path named none.
    pub(crate) fn model_found(&self, cfg: &Config, flow: &mut Flow, model: &[u8]) {
        let keys = &mut flow.fleet_mut().keys;
        for &i in &self.limits {
            let LimitKey::Model { header } = &cfg.limits[i].key else {
                continue;
            };
            let Some(at) = keys.iter().position(|(l, _)| *l == i) else {
                continue;
            };
            let value = match header {
                None => key_value(model),
                Some(_) => {
                    let prefix = keys[at].1.strip_suffix("+-").map(str::to_string);
                    prefix.and_then(|p| key_value(&[p.as_bytes(), b"+", model].concat()))
                }
            };
            match value {
                Some(v) => keys[at].1 = v,
                None => {
                    keys.remove(at);
                }
            }
        }
    }
}

/// The holds a fleet slot's stream still has, to give back at its end: one on both limits
/// while the cap's and the guard's are still the hold admission took, else each on its own.
pub(crate) fn slot_holds(charge: &FleetCharge) -> Vec<(Names, &str)> {
    match (charge.reservation.as_deref(), charge.guard.as_deref()) {
        (Some(r), Some(g)) if r == g => vec![(Names::Both, r)],
        (r, g) => [(Names::Limit, r), (Names::Guard, g)]
            .into_iter()
            .filter_map(|(part, id)| Some((part, id?)))
            .collect(),
    }
}

/// What admission asks of `of`: a fleet slot names its cap and its guard, one hold of both.
fn descriptor(cfg: &Config, of: Of, key: String) -> Descriptor {
    match of {
        Of::Limit(i) if cfg.limits[i].kind == LimitKind::InFlight => {
            slot_descriptor(cfg, i, key, Names::Both)
        }
        Of::Limit(i) => descriptor_of(&cfg.limits[i].name, key),
        Of::Turn => descriptor_of(TURN_LIMIT, key),
        Of::Peek => descriptor_of(COOLING_LIMIT, key),
    }
}

fn slot_descriptor(cfg: &Config, limit: usize, key: String, names: Names) -> Descriptor {
    Descriptor {
        limit: cfg.limits[limit].name.clone(),
        key,
        names,
    }
}

fn descriptor_of(limit: &str, key: String) -> Descriptor {
    Descriptor {
        limit: limit.to_string(),
        key,
        names: Names::Limit,
    }
}

/// A header's value when it is not a credential (`-` when it is missing, as local limits
/// count it); None for a credential header, whose value only ever goes out as its id.
fn plain_header<'h>(cfg: &Config, name: &str, headers: &'h Headers) -> Option<&'h [u8]> {
    if cfg.account_headers.iter().any(|a| a == name) {
        return None;
    }
    Some(headers.get(name).unwrap_or(b"-"))
}

/// A descriptor value: printable UTF-8 of at most `MAX_KEY_VALUE` bytes, else None (the keyed
/// id is sent instead).
fn key_value(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?;
    (s.len() <= MAX_KEY_VALUE && !s.chars().any(char::is_control)).then(|| s.to_string())
}
