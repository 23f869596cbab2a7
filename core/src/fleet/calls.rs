//! A worker's calls to the fleet's service: their sequence numbers, the calls owed by no
//! stream (commits and releases after a stream is gone) until the host takes them, and every
//! call the host sent until its answer comes or its stream ends. The host reports what it sent
//! (`sent`) and what came back (`done`); an answer for a call that is not here (its stream
//! went on or ended, or the load-time health check) is dropped here, once, for every host.

use super::grpc::{ServiceCall, ServiceReply};
use super::limits::{self, FleetLimits, Grant};
use super::rls::Names;
use super::turn::TurnKey;
use crate::config::{Config, LimitKind};
use crate::metrics::{Counter, Metrics};
use crate::request::FleetCharge;

/// A call the host holds, by its token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Out {
    pub owner: Owner,
    pub token: u64,
    pub seq: u32,
}

/// Whose a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// A stream's admission.
    Stream(u32),
    /// Owed by no stream (a commit, a release), counted on this pool.
    Nobody { pool: usize },
    /// A turn taken again: its answer says whether this worker keeps it.
    Turn(TurnKey),
    /// A turn given back to be taken again until `until_ms` once the service has it back (a
    /// hold of the whole limit cannot be taken twice).
    Renew { key: TurnKey, until_ms: u64 },
    /// A turn taken until `until_ms` by a worker that learned a cooldown (`watch`).
    Take { key: TurnKey, until_ms: u64 },
    /// A check whether another Envoy cools a (pool, account) (`watch`).
    Peek(TurnKey),
    /// A check whether anything cools in the fleet (`watch`), counted on this pool.
    PeekAny { pool: usize },
    /// A step of a stream's renewal of its fleet slot (`slots`).
    Slot(SlotCall),
}

/// A step of stream `stream`'s renewal of its fleet slot of `limit`: of its hold on the cap
/// or on the guard (`part`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotCall {
    pub stream: u32,
    pub limit: usize,
    pub part: Names,
    pub step: SlotStep,
}

/// A step of a fleet slot's renewal (`slots`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotStep {
    /// A new hold beside the old one.
    Renew,
    /// A new hold sent with the old one's release (the cap had no room beside it).
    Retake,
    /// Once more, the release having reached the service first this time.
    Last,
}

/// What an answer the call table was waiting for is for.
#[derive(Debug, PartialEq, Eq)]
pub enum Done {
    /// Call `seq` of stream `id`'s admission.
    Stream { id: u32, seq: u32 },
    /// A turn taken again.
    Turn(TurnKey),
    /// A turn given back, to take again until `until_ms`.
    Renew { key: TurnKey, until_ms: u64 },
    /// A turn taken by a worker that learned a cooldown.
    Take { key: TurnKey, until_ms: u64 },
    /// A check of another Envoy's cooldown marker.
    Peek(TurnKey),
    /// A check of the fleet's marker, counted on `pool`.
    PeekAny { pool: usize },
    /// A step of a fleet slot's renewal; `key` is the slot's descriptor key.
    Slot { call: SlotCall, key: String },
}

impl Owner {
    fn stream(self) -> Option<u32> {
        match self {
            Owner::Stream(id) => Some(id),
            Owner::Nobody { .. }
            | Owner::Turn(_)
            | Owner::Renew { .. }
            | Owner::Take { .. }
            | Owner::Peek(_)
            | Owner::PeekAny { .. }
            | Owner::Slot(_) => None,
        }
    }
}

#[derive(Debug)]
pub struct Calls {
    next_seq: u32,
    /// Calls owed by no stream, with whose they are, until the host takes them.
    owed: Vec<(Owner, ServiceCall)>,
    /// Owed calls the host took and has not said it sent.
    taken: Vec<(u32, Owner)>,
    /// Calls out: a few at a time, a list.
    out: Vec<Out>,
    /// The descriptor key of each slot renewal's call (`Owner::Slot`), by seq.
    slot_keys: Vec<(u32, String)>,
}

impl Default for Calls {
    fn default() -> Calls {
        Calls {
            next_seq: 1,
            owed: Vec::new(),
            taken: Vec::new(),
            out: Vec::new(),
            slot_keys: Vec::new(),
        }
    }
}

impl Calls {
    /// `n` consecutive sequence numbers; the first (never 0).
    pub fn reserve(&mut self, n: u32) -> u32 {
        if self.next_seq.checked_add(n).is_none() {
            self.next_seq = 1;
        }
        let first = self.next_seq;
        self.next_seq += n;
        first
    }

    /// Owe `call` (its seq from `reserve`; counted on `pool`), for the host to send from its
    /// timer.
    pub fn owe(&mut self, pool: usize, call: ServiceCall) {
        self.owed.push((Owner::Nobody { pool }, call));
    }

    /// Owe `call` for `owner` (a turn's): its answer comes back from `done`.
    pub fn owe_for(&mut self, owner: Owner, call: ServiceCall) {
        self.owed.push((owner, call));
    }

    /// Owe a step of a slot's renewal (`Owner::Slot`) about the slot keyed `key`.
    pub fn owe_slot(&mut self, owner: Owner, call: ServiceCall, key: String) {
        self.slot_keys.push((call.seq, key));
        self.owe_for(owner, call);
    }

    fn slot_key(&mut self, seq: u32) -> String {
        match self.slot_keys.iter().position(|(s, _)| *s == seq) {
            Some(at) => self.slot_keys.swap_remove(at).1,
            None => String::new(),
        }
    }

    /// Owe a commit of each token budget a stream was charged, with what it used, and the
    /// release of each of its fleet slots.
    pub fn owe_commits(
        &mut self,
        fleet: &FleetLimits,
        cfg: &Config,
        pool: usize,
        charges: &[FleetCharge],
    ) {
        for charge in charges {
            if cfg.limits[charge.limit].kind == LimitKind::InFlight {
                for (part, id) in limits::slot_holds(charge) {
                    let seq = self.reserve(1);
                    let of = (charge.limit, charge.key.clone(), part);
                    self.owe(pool, fleet.slot_release(cfg, of, id, seq));
                }
                continue;
            }
            let seq = self.reserve(1);
            if let Some(call) = fleet.settle_call(cfg, charge, seq) {
                self.owe(pool, call);
            }
        }
    }

    /// Owe a release (a Commit of 0) of each reservation a request will not use.
    pub fn owe_releases(
        &mut self,
        fleet: &FleetLimits,
        cfg: &Config,
        pool: usize,
        grants: &[Grant],
    ) {
        for grant in grants {
            let seq = self.reserve(1);
            self.owe(pool, fleet.release_call(cfg, grant, seq));
        }
    }

    pub fn owes(&self) -> bool {
        !self.owed.is_empty()
    }

    /// The owed calls, for the host to send (and report with `sent` or `not_sent`).
    pub fn take_owed(&mut self) -> Vec<ServiceCall> {
        let owed = std::mem::take(&mut self.owed);
        owed.into_iter()
            .map(|(owner, call)| {
                self.taken.push((call.seq, owner));
                call
            })
            .collect()
    }

    /// The host sent call `seq` of `stream` (None: an owed call) as `token`.
    pub fn sent(&mut self, stream: Option<u32>, token: u64, seq: u32) {
        let owner = match stream {
            Some(id) => Owner::Stream(id),
            None => match self.untake(seq) {
                Some(owner) => owner,
                None => return, // not a call this worker owed
            },
        };
        self.out.push(Out { owner, token, seq });
    }

    /// The host could not send the owed call `seq`: a failed call.
    pub fn not_sent(&mut self, seq: u32, metrics: &mut dyn Metrics) -> Option<Done> {
        match self.untake(seq)? {
            Owner::Nobody { pool } | Owner::PeekAny { pool } => {
                metrics.count(pool, Counter::FleetErrors);
                None
            }
            Owner::Turn(key) | Owner::Renew { key, .. } => Some(Done::Turn(key)),
            Owner::Take { key, .. } | Owner::Peek(key) => {
                metrics.count(key.pool, Counter::FleetErrors);
                None
            }
            Owner::Slot(call) => Some(Done::Slot {
                call,
                key: self.slot_key(seq),
            }),
            Owner::Stream(_) => None,
        }
    }

    fn untake(&mut self, seq: u32) -> Option<Owner> {
        let at = self.taken.iter().position(|(s, _)| *s == seq)?;
        Some(self.taken.swap_remove(at).1)
    }

    /// Whose call `token` is: its stream's, or None (an owed call, or none out). For a host
    /// that hears answers on another context than the call's: proxy-wasm answers a call that a
    /// stream's reaction sent from a tick on the root context.
    pub fn stream_of(&self, token: u64) -> Option<u32> {
        self.out
            .iter()
            .find(|c| c.token == token)
            .and_then(|c| c.owner.stream())
    }

    /// The answer to `token` (sent for `stream`) came. A call owed by no stream (a commit, a
    /// release) is only counted; for a stream's call or a turn's still awaited: whose it is.
    pub fn done(
        &mut self,
        stream: Option<u32>,
        token: u64,
        reply: ServiceReply,
        metrics: &mut dyn Metrics,
    ) -> Option<Done> {
        let at = self
            .out
            .iter()
            .position(|c| c.token == token && c.owner.stream() == stream)?;
        let out = self.out.swap_remove(at);
        match out.owner {
            Owner::Stream(id) => Some(Done::Stream { id, seq: out.seq }),
            Owner::Turn(key) => Some(Done::Turn(key)),
            Owner::Renew { key, until_ms } => Some(Done::Renew { key, until_ms }),
            Owner::Take { key, until_ms } => {
                count_failed(reply, key.pool, metrics);
                Some(Done::Take { key, until_ms })
            }
            Owner::Peek(key) => Some(Done::Peek(key)),
            Owner::PeekAny { pool } => Some(Done::PeekAny { pool }),
            Owner::Slot(call) => Some(Done::Slot {
                call,
                key: self.slot_key(out.seq),
            }),
            Owner::Nobody { pool } => {
                let c = match reply {
                    ServiceReply::Message(_) => Counter::FleetCallsOk,
                    ServiceReply::Failed(_) => Counter::FleetErrors,
                };
                metrics.count(pool, c);
                None
            }
        }
    }

    /// Stream `id` ended: its calls still out are cancelled with it (Envoy cancels them), and
    /// an answer that comes anyway is dropped.
    pub fn forget(&mut self, id: u32) {
        if !self.out.is_empty() {
            self.out.retain(|c| c.owner != Owner::Stream(id));
        }
    }

    /// Calls out now (sent, not answered).
    pub fn out(&self) -> usize {
        self.out.len()
    }
}

/// A turn taken by the watch (`fleet::watch`) that failed is counted as every failed call is.
fn count_failed(reply: ServiceReply, pool: usize, metrics: &mut dyn Metrics) {
    if let ServiceReply::Failed(_) = reply {
        metrics.count(pool, Counter::FleetErrors);
    }
}
