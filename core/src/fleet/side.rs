//! A worker's side of the fleet's service, kept together for the Worker: the calls it owes and
//! has out (`calls`), the turns it holds and the (pool, account)s it watches (`turn`, `watch`).
//! What each call and answer means is decided in its own room (`handoff`, `watch`, `slots`,
//! `ask`); this only hands them what they need.

use super::calls::{Calls, Done};
use super::grpc::ServiceReply;
use super::handoff;
use super::turn::{TurnKey, Turns};
use super::watch::PEEK_MS;
use crate::effects::TICK_MS;
use crate::env::Env;
use crate::hold::Holds;
use crate::metrics::Metrics;
use crate::policy::Governor;
use crate::request::Flow;
use crate::store::SharedStore;

pub struct FleetSide {
    pub calls: Calls,
    /// The (pool, account)s whose turn this worker holds, and what it watches.
    pub turns: Turns,
}

impl FleetSide {
    /// A worker's side of `gov`'s fleet: with `fleet.cooldowns` it watches the fleet's marker
    /// from the start.
    pub fn new(gov: &Governor) -> FleetSide {
        let cooldowns = gov.fleet().is_some_and(|f| f.cooldowns);
        FleetSide {
            calls: Calls::default(),
            turns: Turns::new(cooldowns),
        }
    }

    /// When a tick next has something to do here (a turn to tend, a marker to check).
    pub fn next_check_ms(&self) -> Option<u64> {
        self.turns.next_check_ms(TICK_MS)
    }

    /// How often a host should tick, given whether the worker has streams waiting or held:
    /// every `TICK_MS` while it has, or a call is owed or a turn kept; every `PEEK_MS` while
    /// only something watched may be due (`watch`); None: never.
    pub fn tick_ms(&self, busy: bool) -> Option<u64> {
        if busy || self.calls.owes() || !self.turns.is_empty() {
            return Some(TICK_MS);
        }
        (!self.turns.watch.is_empty()).then_some(PEEK_MS)
    }

    /// Tend the turns, and check or mark what is watched, at `now` (`handoff::tend`).
    pub fn tend(&mut self, gov: &Governor, holds: &Holds, store: &dyn SharedStore, now: u64) {
        handoff::tend(&mut self.turns, &mut self.calls, gov, holds, store, now);
    }

    /// Stream `id` ended: its calls still out are cancelled with it, and the turns are tended
    /// (a native worker may not tick again: the turn a last stream leaves is given back here).
    pub fn ended(
        &mut self,
        id: u32,
        gov: &Governor,
        holds: &Holds,
        store: &dyn SharedStore,
        clock: impl FnOnce() -> u64,
    ) {
        self.calls.forget(id);
        if !self.turns.is_empty() {
            self.tend(gov, holds, store, clock());
        }
    }

    /// The provider's answer for `key` started a cooldown here: the fleet learns it
    /// (`handoff::learned`), when its cooldowns are shared.
    pub fn learned(
        &mut self,
        gov: &Governor,
        key: TurnKey,
        store: &dyn SharedStore,
        clock: impl FnOnce() -> u64,
    ) {
        if gov.fleet().is_some_and(|f| f.cooldowns) {
            handoff::learned(&mut self.turns, &mut self.calls, gov, key, store, clock());
        }
    }

    /// A request's calls were all answered: if one checked its (pool, account)'s marker, what
    /// this worker knows of it is fresh (`watch`).
    pub fn answered_about(&mut self, flow: &Flow, peeked: bool, clock: impl FnOnce() -> u64) {
        if peeked {
            self.turns.watch.checked(TurnKey::of(flow), clock);
        }
    }

    /// An answer to a call about a turn or a marker (`handoff::answered`).
    pub fn answered(&mut self, done: Done, reply: ServiceReply, gov: &Governor, env: &mut Env) {
        handoff::answered(done, reply, &mut self.turns, &mut self.calls, gov, env);
    }

    /// The host could not send the owed call `seq`: a failed call. A slot's renewal step is
    /// the worker's to go on with (it is a stream's).
    pub fn not_sent(&mut self, seq: u32, metrics: &mut dyn Metrics) -> Option<Done> {
        match self.calls.not_sent(seq, metrics)? {
            Done::Turn(key) => {
                self.turns.renewed(key, None);
                None
            }
            done => Some(done),
        }
    }
}
