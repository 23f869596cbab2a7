//! A fleet slot held while its stream lasts (`max_in_flight` with `scope: "fleet"`). A slot is
//! a hold of 1 for `slot_lease_ms` on two limits of the service with the same cap: the cap
//! (its descriptor's entry `limit`) and the cap's guard (`guard`). Admission asks both in one
//! Reserve, so a request goes only while both have room. A stream still going two thirds into
//! the lease takes each hold again, the cap's first, then the guard's: a new hold beside the
//! old one (a Reserve of 1: granted while that limit has room, then the old one is given back);
//! else, that limit being full, the old one given back and a new one asked for together (and
//! once more if the service saw the new one first). Reserve/Commit cannot extend a hold, so
//! in that moment the limit has a free unit, but the other one, still held, keeps out every
//! request waiting for a slot (it needs both). Only when two streams take the cap and the
//! guard again at the same moment can a waiting request slip in: the stream that lost goes on
//! past its slot, counted in `fleet_calls_over_limit`, and asks again at its next renewal. A
//! service without the guard in its limits file grants the guard's Reserve holding nothing:
//! the slot is the cap alone (a waiting request may then take a full cap's slot while it is
//! taken again), said once in Envoy's log.

use std::sync::atomic::AtomicBool;

use super::calls::{Calls, Owner, SlotCall, SlotStep};
use super::grpc::{self, ServiceReply};
use super::limits::FleetLimits;
use super::rls::{self, Code, Names};
use crate::config::{Config, LimitKind};
use crate::metrics::{Counter, Metrics};
use crate::policy::Governor;
use crate::request::{FleetCharge, Flow};
use crate::stream::Streams;

/// How far into its lease a slot's hold is taken again.
pub fn renew_after_ms(lease_ms: u64) -> u64 {
    lease_ms / 3 * 2
}

/// The slots among `charges`, granted at `now`: each is taken again two thirds into its lease.
pub fn arm(cfg: &Config, charges: &mut [FleetCharge], now: u64) {
    for c in charges {
        let limit = &cfg.limits[c.limit];
        if limit.kind == LimitKind::InFlight && c.reservation.is_some() {
            c.renew_at_ms = Some(now + renew_after_ms(limit.slot_lease_ms));
        }
    }
}

/// Stream `id`'s slots are due at `now` (its wait in `streams` came): taken again.
pub(crate) fn renew_due(
    gov: &Governor,
    calls: &mut Calls,
    streams: &mut Streams,
    id: u32,
    now: u64,
) {
    if let Some(fleet) = gov.fleet() {
        let renew = |flow: &mut Flow| renew(fleet, &gov.cfg, calls, id, flow, now);
        streams.with_upstream(id, renew);
    }
}

/// A step of a slot's renewal (`call`, about the slot keyed `key`) was answered: `answered`
/// with its stream's flow, if it is still upstream.
pub(crate) fn reply(
    gov: &Governor,
    calls: &mut Calls,
    streams: &mut Streams,
    metrics: &mut dyn Metrics,
    (call, key): (SlotCall, String),
    reply: ServiceReply,
    now: u64,
) {
    let Some(fleet) = gov.fleet() else {
        return;
    };
    let mut key = Some(key);
    let mut answered = |flow: Option<&mut Flow>| {
        let key = key.take().unwrap_or_default();
        let to = To {
            fleet,
            cfg: &gov.cfg,
            calls: &mut *calls,
        };
        to.answered(metrics, (call, key), reply, flow, now)
    };
    if streams
        .with_upstream(call.stream, |flow| answered(Some(flow)))
        .is_none()
    {
        answered(None);
    }
}

/// Stream `id`'s slots due at `now` are taken again: the cap's hold first (owed).
fn renew(fleet: &FleetLimits, cfg: &Config, calls: &mut Calls, id: u32, flow: &mut Flow, now: u64) {
    let Some(f) = flow.fleet.as_mut() else {
        return;
    };
    for c in f.charges.iter_mut() {
        if c.renew_at_ms.is_some_and(|at| at <= now) {
            c.renew_at_ms = None;
            To { fleet, cfg, calls }.ask(id, c, Names::Limit, SlotStep::Renew);
        }
    }
}

/// What a renewal's Reserve was answered.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Said {
    Granted(String),
    /// Granted holding nothing: no limit of that name (a guard the limits file lacks).
    Unheld,
    Full,
    Failed,
}

fn said(reply: ServiceReply) -> Said {
    let ServiceReply::Message(bytes) = reply else {
        return Said::Failed;
    };
    match rls::decode_reserve(bytes) {
        Ok(a) if a.code == Some(Code::Ok) => match a.reservation.filter(|r| !r.is_empty()) {
            Some(r) => Said::Granted(r),
            None => Said::Unheld,
        },
        Ok(a) if a.code == Some(Code::OverLimit) => Said::Full,
        _ => Said::Failed,
    }
}

/// The hold of `charge` on its cap or its guard.
fn hold(charge: &mut FleetCharge, part: Names) -> &mut Option<String> {
    match part {
        Names::Guard => &mut charge.guard,
        Names::Limit | Names::Both => &mut charge.reservation,
    }
}

/// Where a slot's calls go: the worker's call table, with what builds them.
struct To<'a> {
    fleet: &'a FleetLimits,
    cfg: &'a Config,
    calls: &'a mut Calls,
}

impl To<'_> {
    /// A step of the renewal of stream `call.stream`'s slot (keyed `key`) was answered.
    /// `flow` is the stream's, None once it ended. Owes what follows: the old hold given back
    /// once a new one is granted; with the limit full, the old one given back and then a new
    /// one taken; after the cap, the guard; a hold no stream needs any more given back.
    fn answered(
        mut self,
        metrics: &mut dyn Metrics,
        (call, key): (SlotCall, String),
        reply: ServiceReply,
        flow: Option<&mut Flow>,
        now: u64,
    ) {
        let SlotCall {
            stream,
            limit,
            part,
            step,
        } = call;
        let pool = flow.as_ref().map_or(0, |f| f.pool);
        let charge = flow.and_then(|f| {
            let f = f.fleet.as_mut()?;
            f.charges.iter_mut().find(|c| c.limit == limit)
        });
        let said = said(reply);
        let Some(charge) = charge else {
            // The stream ended meanwhile: a hold granted for it is given back at once.
            if let Said::Granted(id) = said {
                self.release((limit, key, part), id, pool);
            }
            return;
        };
        let done = match (said, step) {
            (Said::Granted(id), _) => {
                if let Some(old) = hold(charge, part).replace(id) {
                    self.release((limit, key, part), old, pool);
                }
                true
            }
            // No room beside the old hold: give it back and take a new one in the same breath
            // (the service may see the new one first: then once more).
            (Said::Full, SlotStep::Renew) if hold(charge, part).is_some() => {
                let old = hold(charge, part).take().unwrap_or_default();
                self.release((limit, key, part), old, pool);
                self.ask(stream, charge, part, SlotStep::Retake);
                false
            }
            (Said::Full, SlotStep::Retake) => {
                self.ask(stream, charge, part, SlotStep::Last);
                false
            }
            // Taken by a request that was waiting for a slot (or lost before): the stream goes
            // on past this hold, counted, and asks again at its next renewal.
            (Said::Full, _) => {
                metrics.count(pool, Counter::FleetCallsOverLimit);
                true
            }
            (Said::Unheld, _) if part == Names::Guard => {
                charge.unguarded = true;
                charge.guard = None;
                warn_unguarded(&self.cfg.limits[limit].name);
                true
            }
            (Said::Unheld | Said::Failed, _) => {
                metrics.count(pool, Counter::FleetErrors);
                true
            }
        };
        if !done {
            return;
        }
        if part == Names::Limit && !charge.unguarded {
            self.ask(stream, charge, Names::Guard, SlotStep::Renew);
        } else {
            let lease_ms = self.cfg.limits[limit].slot_lease_ms;
            charge.renew_at_ms = Some(now + renew_after_ms(lease_ms));
        }
    }

    /// Owe a Reserve of 1 on `charge`'s cap or guard for stream `stream`, as step `step`.
    fn ask(&mut self, stream: u32, charge: &FleetCharge, part: Names, step: SlotStep) {
        let seq = self.calls.reserve(1);
        let owner = Owner::Slot(SlotCall {
            stream,
            limit: charge.limit,
            part,
            step,
        });
        let of = (charge.limit, charge.key.clone(), part);
        let call = self.fleet.slot_call(self.cfg, of, seq);
        self.calls.owe_slot(owner, call, charge.key.clone());
    }

    /// Owe the release (a Commit of 0) of `reservation`, a hold on `of`.
    fn release(&mut self, of: (usize, String, Names), reservation: String, pool: usize) {
        let seq = self.calls.reserve(1);
        let call = self.fleet.slot_release(self.cfg, of, &reservation, seq);
        self.calls.owe(pool, call);
    }
}

/// Said once per worker: a service without the guard of a fleet cap.
fn warn_unguarded(limit: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    grpc::warn_once(&WARNED, || {
        format!(
            "llm_governor: the rate-limit service has no guard for the fleet max_in_flight \
             {limit:?}: a stream longer than its slot_lease_ms may lose its slot to a waiting \
             request while taking it again; add the limit a second time to its limits file, \
             with the same max_value and the condition descriptors[0]['guard'] == '{limit}'"
        )
    });
}
