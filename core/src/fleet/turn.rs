//! Cooldowns shared by a fleet (`fleet.cooldowns`): one probe per provider round and one
//! release pace for every Envoy. Each Envoy learns a cooldown from the provider as before (its
//! own 429, or headers saying nothing is left) and holds its requests through it; what the
//! cooldown's pace then lets go (the probe, and the releases the provider's `remaining` allows)
//! leaves only from the worker that holds the (pool, account)'s turn: a hold of 1 on the
//! service's limit `llm_governor_turn` (its `max_value` 1), taken with Reserve, given back with
//! a Commit of 0. So a provider round costs the whole fleet one probe, and after recovery the
//! fleet together sends what `remaining` says, read from the answers of the one worker sending.
//!
//! A worker keeps its turn while the provider keeps its (pool, account) cooling (it takes the
//! turn again for the rest of a cooldown that outlasts it: a cooldown never shortens), and gives
//! it back once it has nothing more to send and the provider has room; a turn whose holder died
//! comes back when its hold expires. Nothing is asked while nothing is cooling: a request the
//! local gate lets through unpaced never asks.

use super::grpc::ServiceReply;
pub use super::key::TurnKey;
use super::rls::{self, Code};
use super::watch::Watch;
use crate::request::Flow;

/// The service's limit whose holds are the turns (`max_value: 1`; see the shipped limits file).
pub const TURN_LIMIT: &str = "llm_governor_turn";
/// The service's limit a cooling (pool, account) is marked on (`max_value: 1`, `seconds: 1`;
/// see the shipped limits file): an Envoy that learned a cooldown hits it every `MARK_MS`
/// while it cools, and any other Envoy's check of it (`CheckRateLimit`, which counts nothing)
/// is then over its limit. A marker left by an Envoy that died is gone within a second.
pub const COOLING_LIMIT: &str = "llm_governor_cooling";

/// What admission asks of a (pool, account)'s turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnAsk {
    /// Take it for `ttl_ms`: the pace of a cooldown released the request.
    Take { ttl_ms: u64 },
    /// Only look whether the fleet cools it (`COOLING_LIMIT`): this worker has not looked
    /// lately (`watch`).
    Peek,
}

/// How long a turn is taken for, at least: the provider's rounds of an outage of a few seconds
/// stay the holder's without taking the turn again, and a holder that died gives the turn back
/// after it (the fleet's releases of that account wait that long, at most). A turn is taken for
/// longer through an episode of longer cooldowns (`turn_ms`).
pub const TURN_MS: u64 = 10_000;
/// The longest a turn is taken for at once (Limitador's `--max-reservation-ttl` defaults to 60 s).
pub const TURN_MAX_MS: u64 = 60_000;

/// How long to take a turn for, through an episode of cooldowns whose longest provider time is
/// `spread_ms`: long enough that the holder's next round (a probe meeting another "not now")
/// stays its own without taking the turn again, which would leave it free for a moment.
pub fn turn_ms(spread_ms: u64) -> u64 {
    TURN_MS.max(spread_ms.saturating_mul(2)).min(TURN_MAX_MS)
}
/// How soon a worker refused the turn asks again, on average.
pub const TURN_REASK_MS: u64 = 50;

/// A turn this worker holds.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Held {
    key: TurnKey,
    /// The service's reservation id (empty: taken while the service could not coordinate).
    id: String,
    until_ms: u64,
    /// Taken again for a longer time, its answer awaited.
    renewing: bool,
}

/// What a worker does about one of its turns now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tend {
    /// Give it back (a Commit of 0): nothing more to send, and the provider has room.
    Release { key: TurnKey, id: String },
    /// Take it again until `until_ms`: the cooldown outlasts it. The old hold is given back.
    Renew {
        key: TurnKey,
        old: String,
        until_ms: u64,
    },
}

/// The turns one worker holds (a few at a time, a list), and the (pool, account)s it watches
/// for another Envoy's cooldown (`watch`).
#[derive(Debug)]
pub struct Turns {
    held: Vec<Held>,
    /// When `tend` last looked (a kept turn is looked at every tick).
    tended_ms: u64,
    pub watch: Watch,
}

impl Turns {
    /// When a tick (every `tick_ms`) should next tend the turns kept here or check what is
    /// watched: None while nothing is kept or watched.
    pub fn next_check_ms(&self, tick_ms: u64) -> Option<u64> {
        let kept = (!self.held.is_empty()).then(|| self.tended_ms.saturating_add(tick_ms));
        kept.into_iter().chain(self.watch.next_check_ms()).min()
    }

    /// No turn is kept; with `cooldowns` the fleet's marker is watched (`watch`).
    pub fn new(cooldowns: bool) -> Turns {
        Turns {
            held: Vec::new(),
            tended_ms: 0,
            watch: Watch::new(cooldowns),
        }
    }

    /// Whether this worker holds `key`'s turn at `now`.
    pub fn holds(&self, key: TurnKey, now: u64) -> bool {
        self.held.iter().any(|h| h.key == key && h.until_ms > now)
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The service granted `key`'s turn (reservation `id`) until `until_ms`.
    pub fn took(&mut self, key: TurnKey, id: String, until_ms: u64) {
        self.held.retain(|h| h.key != key);
        self.held.push(Held {
            key,
            id,
            until_ms,
            renewing: false,
        });
    }

    /// A request took its turn (the service's reservation `id`) for `ttl_ms` at `now`.
    pub fn took_for(&mut self, flow: &Flow, id: String, ttl_ms: u64, now: u64) {
        self.took(TurnKey::of(flow), id, now + ttl_ms);
    }

    /// A renewal of `key`'s turn was answered: granted (`Some(id)`) or not.
    pub fn renewed(&mut self, key: TurnKey, id: Option<String>) {
        match id {
            Some(id) => {
                if let Some(h) = self.held.iter_mut().find(|h| h.key == key) {
                    h.id = id;
                    h.renewing = false;
                }
            }
            None => self.held.retain(|h| h.key != key),
        }
    }

    /// What to do about each turn at `now`: `queued(key)` says whether this worker still holds
    /// requests for it, `cooling_until(key)` until when the provider keeps it cooling or paced
    /// with nothing to release (None: it has room). Expired turns are forgotten.
    pub fn tend(
        &mut self,
        now: u64,
        mut queued: impl FnMut(TurnKey) -> bool,
        mut cooling_until: impl FnMut(TurnKey) -> Option<u64>,
    ) -> Vec<Tend> {
        self.tended_ms = now;
        self.held.retain(|h| h.until_ms > now);
        let mut out = Vec::new();
        for h in &mut self.held {
            if h.renewing || h.id.is_empty() {
                continue;
            }
            match cooling_until(h.key) {
                // The cooldown (and the probe after it) outlasts the hold: take it again.
                Some(until) if until >= h.until_ms => {
                    let until_ms = until.saturating_add(TURN_MS);
                    out.push(Tend::Renew {
                        key: h.key,
                        old: std::mem::take(&mut h.id),
                        until_ms,
                    });
                    h.until_ms = until_ms;
                    h.renewing = true;
                }
                Some(_) => {}
                None if !queued(h.key) => {
                    out.push(Tend::Release {
                        key: h.key,
                        id: std::mem::take(&mut h.id),
                    });
                    h.until_ms = 0;
                }
                None => {}
            }
        }
        self.held.retain(|h| h.until_ms > now);
        out
    }
}

/// The reservation a turn's Reserve was granted, if the service holds one.
pub fn granted(reply: ServiceReply) -> Option<String> {
    let bytes = match reply {
        ServiceReply::Message(bytes) => bytes,
        ServiceReply::Failed(code) => {
            super::grpc::warn_if_no_reservations(code);
            return None;
        }
    };
    let answer = rls::decode_reserve(bytes).ok()?;
    (answer.code == Some(Code::Ok))
        .then_some(answer.reservation)
        .flatten()
        .filter(|r| !r.is_empty())
}
