//! What a worker owes the fleet's service for its turns (`turn`): a turn handed off (a Commit
//! of 0) when the worker has nothing more to send and the provider has room, or given back and
//! taken again for longer when the provider's cooldown outlasts it; and what the answers to
//! those calls mean.

use super::calls::{Calls, Done, Owner};
use super::grpc::ServiceReply;
use super::limits::{FleetLimits, Grant, Of};
use super::turn::{self, Tend, TurnKey, Turns};
use crate::config::Config;
use crate::hold::Holds;
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
/// release before one (then it is taken again).
pub fn answered(
    done: Done,
    reply: ServiceReply,
    turns: &mut Turns,
    calls: &mut Calls,
    gov: &Governor,
    now: u64,
) {
    match done {
        Done::Turn(key) => turns.renewed(key, turn::granted(reply)),
        Done::Renew { key, until_ms } => {
            if let Some(fleet) = gov.fleet() {
                retake(calls, fleet, &gov.cfg, key, until_ms, now);
            }
        }
        Done::Stream { .. } => {}
    }
}
