//! What a worker owes the fleet's service for its turns (`turn`): a turn handed off (a Commit
//! of 0) when the worker has nothing more to send and the provider has room, or given back and
//! taken again for longer when the provider's cooldown outlasts it; and what the answers to
//! those calls mean.

use super::calls::{Calls, Done, Owner};
use super::grpc::ServiceReply;
use super::limits::{FleetLimits, Grant, Of};
use super::rls::{self, Code};
use super::turn::{self, Tend, TurnKey, Turns};
use super::watch::{Here, Look, ANY_KEY};
use crate::config::Config;
use crate::env::Env;
use crate::hold::Holds;
use crate::metrics::Counter;
use crate::policy::Governor;
use crate::store::SharedStore;

/// Tend this worker's turns at `now` (see `Turns::tend`), owing the service what that takes:
/// a release (a Commit of 0); or, for a turn the cooldown outlasts, a release whose answer
/// takes it again (`retake`: the whole limit cannot be held twice, so the new hold waits for the
/// old one to be gone).
pub fn tend(
    turns: &mut Turns,
    calls: &mut Calls,
    gov: &Governor,
    holds: &Holds,
    store: &dyn SharedStore,
    now: u64,
) {
    let (Some(fleet), cfg) = (gov.fleet(), &gov.cfg) else {
        return;
    };
    look(turns, calls, gov, store, now);
    if turns.is_empty() {
        return;
    }
    let queued = |k: TurnKey| holds.queued_for(k.pool, k.account);
    let cooling_until = |k: TurnKey| gov.cooldowns().busy_until(k.pool, k.account, store, now);
    for act in turns.tend(now, queued, cooling_until) {
        let (key, old, owner) = match act {
            Tend::Release { key, id } => (key, id, Owner::Nobody { pool: key.pool }),
            Tend::Renew { key, old, until_ms } => (key, old, Owner::Renew { key, until_ms }),
        };
        let grant = Grant {
            of: Of::Turn,
            key: key.descriptor_key(cfg),
            reservation: old,
        };
        let seq = calls.reserve(1);
        calls.owe_for(owner, fleet.release_call(cfg, &grant, seq));
    }
}

/// Owe the service what the watch has due at `now` (`Watch::due`): checks of the fleet's
/// marker and of (pool, account)s' markers, marks of what cools here.
fn look(turns: &mut Turns, calls: &mut Calls, gov: &Governor, store: &dyn SharedStore, now: u64) {
    let (Some(fleet), cfg) = (gov.fleet().filter(|f| f.cooldowns), &gov.cfg) else {
        return;
    };
    let here = |k: TurnKey| gov.cooldowns().here(k.pool, k.account, store, now);
    for look in turns.watch.due(now, store, here) {
        let (owner, key) = match look {
            Look::PeekAny => (
                Owner::PeekAny {
                    pool: unmatched(cfg),
                },
                ANY_KEY.into(),
            ),
            Look::Peek(k) => (Owner::Peek(k), k.descriptor_key(cfg)),
            Look::Mark(k) => {
                mark(calls, fleet, cfg, k);
                continue;
            }
        };
        let seq = calls.reserve(1);
        calls.owe_for(owner, fleet.peek_call(key, seq));
    }
}

/// This worker learned a cooldown of `key` from the provider at `now` (an answer it governed):
/// the fleet is told at once (a mark, `watch`), and the turn is taken, unless held here, for
/// the cooldown and the probe after it, so no other Envoy's request takes it meanwhile.
pub fn learned(
    turns: &mut Turns,
    calls: &mut Calls,
    gov: &Governor,
    key: TurnKey,
    store: &dyn SharedStore,
    now: u64,
) {
    let (Some(fleet), cfg) = (gov.fleet().filter(|f| f.cooldowns), &gov.cfg) else {
        return;
    };
    let cooldowns = gov.cooldowns();
    let cools = cooldowns.here(key.pool, key.account, store, now) == Here::Cools;
    if !cools || !turns.watch.learned(key, now) {
        return;
    }
    mark(calls, fleet, cfg, key);
    if !turns.holds(key, now) {
        let ttl_ms = turn::turn_ms(cooldowns.spread_ms(key.pool, key.account, store));
        let seq = calls.reserve(1);
        let until_ms = now + ttl_ms;
        let call = fleet.turn_call(key.descriptor_key(cfg), ttl_ms, seq);
        calls.owe_for(Owner::Take { key, until_ms }, call);
    }
}

/// `key` cools here: its marker and the fleet's are hit (`watch`).
fn mark(calls: &mut Calls, fleet: &FleetLimits, cfg: &Config, key: TurnKey) {
    let pool = key.pool;
    for marker in [key.descriptor_key(cfg), ANY_KEY.into()] {
        let seq = calls.reserve(1);
        calls.owe_for(Owner::Nobody { pool }, fleet.mark_call(marker, seq));
    }
}

/// The pool the fleet's marker is counted on: the unmatched pool, `default`, last.
fn unmatched(cfg: &Config) -> usize {
    cfg.pools.len() - 1
}

/// The old hold of a turn being taken again is gone: take it until `until_ms` (its answer
/// comes to `Turns::renewed`).
pub fn retake(
    calls: &mut Calls,
    fleet: &FleetLimits,
    cfg: &Config,
    key: TurnKey,
    until_ms: u64,
    now: u64,
) {
    let seq = calls.reserve(1);
    let call = fleet.turn_call(
        key.descriptor_key(cfg),
        until_ms.saturating_sub(now).max(1),
        seq,
    );
    calls.owe_for(Owner::Turn(key), call);
}

/// What became of a call about a turn: a Reserve taking it again (granted or not), or the
/// release before one (then it is taken again); a turn taken by a worker that learned a
/// cooldown; a check of another Envoy's marker (over its limit: held here too).
pub fn answered(
    done: Done,
    reply: ServiceReply,
    turns: &mut Turns,
    calls: &mut Calls,
    gov: &Governor,
    env: &mut Env,
) {
    let now = env.now();
    match done {
        Done::Turn(key) => turns.renewed(key, turn::granted(reply)),
        Done::Take { key, until_ms } => {
            if let Some(id) = turn::granted(reply) {
                turns.took(key, id, until_ms);
            }
        }
        Done::Peek(key) => {
            if found(reply, key.pool, env) == Some(true) {
                gov.cooldowns().held_elsewhere(key.pool, key.account, env);
            }
        }
        Done::PeekAny { pool } => {
            // Found where nothing was known to cool: the (pool, account)s watched are checked
            // now, not at the timer's next look.
            let said = found(reply, pool, env);
            if turns.watch.answered(said, now, env.store) {
                look(turns, calls, gov, env.store, now);
            }
        }
        Done::Renew { key, until_ms } => {
            if let Some(fleet) = gov.fleet() {
                retake(calls, fleet, &gov.cfg, key, until_ms, now);
            }
        }
        Done::Stream { .. } | Done::Slot { .. } => {}
    }
}

/// Whether a check of a marker found it (over its limit), counted on `pool`; None for a failed
/// or unreadable answer (the Envoy goes on as without a fleet).
fn found(reply: ServiceReply, pool: usize, env: &mut Env) -> Option<bool> {
    let said = over_limit(reply);
    let counter = match said {
        Some(true) => Counter::FleetCallsOverLimit,
        Some(false) => Counter::FleetCallsOk,
        None => Counter::FleetErrors,
    };
    env.metrics.count(pool, counter);
    said
}

/// Whether a check's answer is over its limit; None for a failed or unreadable one.
fn over_limit(reply: ServiceReply) -> Option<bool> {
    match reply {
        ServiceReply::Message(bytes) => match rls::decode_response(bytes).ok()?.code {
            Some(Code::OverLimit) => Some(true),
            Some(Code::Ok) => Some(false),
            _ => None,
        },
        ServiceReply::Failed(code) => {
            super::grpc::warn_if_no_check(code);
            None
        }
    }
}
