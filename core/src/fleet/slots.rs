//! A fleet slot held while its stream lasts (`max_in_flight` with `scope: "fleet"`). A slot is a
//! hold of 1 for `slot_lease_ms`; a stream still going two thirds into the lease takes its slot
//! again: first a new hold beside the old one (a Reserve of 1: granted while the cap has room,
//! then the old one is given back), else, the cap being full, the old one given back and a new
//! one asked for together (and once more if the service saw the new one first). Reserve/Commit
//! cannot extend a hold, so in that second case a request of another Envoy waiting for a slot
//! may take it in between: the stream then goes on past its slot (counted in
//! `fleet_calls_over_limit`), as every stream did at its lease before renewal.

use super::calls::{Calls, Owner, SlotStep};
use super::grpc::ServiceReply;
use super::limits::{FleetLimits, Grant, Of};
use super::rls::{self, Code};
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

/// A step of stream `of.0`'s slot renewal was answered: `answered` with its flow, if it is
/// still upstream.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reply(
    gov: &Governor,
    calls: &mut Calls,
    streams: &mut Streams,
    metrics: &mut dyn Metrics,
    of: (u32, usize, SlotStep),
    key: String,
    reply: ServiceReply,
    now: u64,
) {
    let Some(fleet) = gov.fleet() else {
        return;
    };
    let mut key = Some(key);
    let mut answered = |flow: Option<&mut Flow>| {
        let key = key.take().unwrap_or_default();
        answered(fleet, &gov.cfg, calls, metrics, of, key, reply, flow, now)
    };
    if streams
        .with_upstream(of.0, |flow| answered(Some(flow)))
        .is_none()
    {
        answered(None);
    }
}

/// Stream `id`'s slots due at `now` are taken again (a Reserve of 1 each, owed).
fn renew(fleet: &FleetLimits, cfg: &Config, calls: &mut Calls, id: u32, flow: &mut Flow, now: u64) {
    let Some(f) = flow.fleet.as_mut() else {
        return;
    };
    for c in f.charges.iter_mut() {
        if c.renew_at_ms.is_some_and(|at| at <= now) {
            c.renew_at_ms = None;
            reserve(fleet, cfg, calls, id, c, SlotStep::Renew);
        }
    }
}

/// What a renewal's Reserve was answered.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Said {
    Granted(String),
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
            None => Said::Failed,
        },
        Ok(a) if a.code == Some(Code::OverLimit) => Said::Full,
        _ => Said::Failed,
    }
}

/// A step of the renewal of stream `stream`'s slot of `limit` (keyed `key`) was answered.
/// `flow` is the stream's, None once it ended. Owes what follows: the old hold given back once
/// a new one is granted; with the cap full, the old one given back and then a new one taken;
/// a hold no stream needs any more given back.
#[allow(clippy::too_many_arguments)]
pub fn answered(
    fleet: &FleetLimits,
    cfg: &Config,
    calls: &mut Calls,
    metrics: &mut dyn Metrics,
    (stream, limit, step): (u32, usize, SlotStep),
    key: String,
    reply: ServiceReply,
    flow: Option<&mut Flow>,
    now: u64,
) {
    let pool = flow.as_ref().map_or(0, |f| f.pool);
    let charge = flow.and_then(|f| {
        let f = f.fleet.as_mut()?;
        f.charges.iter_mut().find(|c| c.limit == limit)
    });
    let said = said(reply);
    let Some(charge) = charge else {
        // The stream ended meanwhile: a hold granted for it is given back at once.
        if let Said::Granted(id) = said {
            release(fleet, cfg, calls, limit, key, id, pool);
        }
        return;
    };
    match said {
        Said::Granted(id) => {
            if let Some(old) = charge.reservation.replace(id) {
                release(fleet, cfg, calls, limit, key, old, pool);
            }
            let lease_ms = cfg.limits[limit].slot_lease_ms;
            charge.renew_at_ms = Some(now + renew_after_ms(lease_ms));
        }
        Said::Full if step == SlotStep::Renew => {
            // No room beside the old hold: give it back and take a new one in the same breath
            // (the service may see the new one first: then once more).
            let old = charge.reservation.take().unwrap_or_default();
            release(fleet, cfg, calls, limit, key, old, pool);
            reserve(fleet, cfg, calls, stream, charge, SlotStep::Retake);
        }
        Said::Full if step == SlotStep::Retake => {
            reserve(fleet, cfg, calls, stream, charge, SlotStep::Last);
        }
        // Taken by a request that was waiting for a slot, or the service failed: the stream
        // goes on past its slot, counted.
        Said::Full => metrics.count(pool, Counter::FleetCallsOverLimit),
        Said::Failed => metrics.count(pool, Counter::FleetErrors),
    }
}

fn reserve(
    fleet: &FleetLimits,
    cfg: &Config,
    calls: &mut Calls,
    stream: u32,
    charge: &FleetCharge,
    step: SlotStep,
) {
    let seq = calls.reserve(1);
    let owner = Owner::Slot {
        stream,
        limit: charge.limit,
        step,
    };
    let call = fleet.slot_call(cfg, charge, seq);
    calls.owe_slot(owner, call, charge.key.clone());
}

fn release(
    fleet: &FleetLimits,
    cfg: &Config,
    calls: &mut Calls,
    limit: usize,
    key: String,
    reservation: String,
    pool: usize,
) {
    let grant = Grant {
        of: Of::Limit(limit),
        key,
        reservation,
    };
    let seq = calls.reserve(1);
    calls.owe(pool, fleet.release_call(cfg, &grant, seq));
}
