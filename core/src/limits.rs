//! Local limits: request buckets, token budgets and `max_in_flight` slots, taken together or
//! not at all. A request refused by one limit gives back what earlier limits gave it, so a
//! held request that asks again on every tick never drains a bucket it does not use.

use crate::blocked::Blocked;
use crate::bucket::{Bucket, Shape};
use crate::classify::Dialect;
use crate::config::{Config, Counts, Limit, LimitKind, Scope, Settle};
use crate::counting::{self, Reserve};
use crate::env::Env;
use crate::inflight::{self, Slots};
use crate::keys;
use crate::keyspace;
use crate::lease;
use crate::metrics::Gauge;
use crate::predict::{self, Needs};
use crate::ratelimit::Need;
use crate::request::{Charge, Flow, HeldSlot, Taken};
use crate::store::{self, UpdateError};
use crate::usage::Usage;

/// The key a take goes to, as `existing_or_overflow` found it.
struct Target {
    key: String,
    /// Its value and CAS token when it exists: the first read of the update.
    known: Option<(Vec<u8>, u32)>,
    /// The request's own key (false: the limit's overflow key, past `max_keys`).
    own: bool,
}

/// The configured limits (a view of the governor's), and the bound on their keys.
#[derive(Clone, Copy)]
pub struct Limits<'a> {
    cfg: &'a Config,
    limits: &'a [Limit],
    max_keys: u64,
    /// What the reserving token limits need predicted before the call.
    needs: Needs,
    /// Some limits are the fleet's: what the local ones took is kept on the flow, to give
    /// back if the fleet refuses the request.
    fleet: bool,
}

impl<'a> Limits<'a> {
    pub fn new(cfg: &'a Config, needs: Needs, fleet: bool) -> Limits<'a> {
        Limits {
            cfg,
            limits: &cfg.limits,
            max_keys: cfg.max_keys,
            needs,
            fleet,
        }
    }

    /// Take every local limit of the flow, or none (the fleet's limits are the service's to
    /// decide). Shared-data failures admit (fail-open) and count `store_contention`: the
    /// governor never rejects traffic because of its own bookkeeping.
    pub(crate) fn take(&self, flow: &mut Flow, env: &mut Env) -> Result<(), Blocked> {
        self.take_where(flow, env, None)
    }

    /// Take the fleet limits `which` in this Envoy's own buckets of the same rate: the fleet's
    /// service could not answer and the fallback is `local`.
    pub(crate) fn take_fallback(
        &self,
        flow: &mut Flow,
        which: &[usize],
        env: &mut Env,
    ) -> Result<(), Blocked> {
        self.take_where(flow, env, Some(which))
    }

    /// Give back what the flow's local limits took at admission: the fleet refused it.
    pub(crate) fn undo(&self, flow: &mut Flow, env: &mut Env) {
        let taken = flow
            .fleet
            .as_mut()
            .map(|f| std::mem::take(&mut f.taken))
            .unwrap_or_default();
        let mut slots = std::mem::take(&mut flow.slots);
        let n = slots.len() as i64;
        self.give_back(taken, &mut slots, flow.pool, env);
        if n > 0 {
            in_flight_moved(env, flow.pool, -n);
        }
        flow.charges.clear();
    }

    // Once, not inlined into each admission path: the module carries one copy.
    #[inline(never)]
    /// Take the local limits (`only` None), or the limits `only` names.
    fn take_where(
        &self,
        flow: &mut Flow,
        env: &mut Env,
        only: Option<&[usize]>,
    ) -> Result<(), Blocked> {
        let applies = |i: usize, l: &Limit| match only {
            None => l.scope == Scope::Local,
            Some(which) => which.contains(&i),
        };
        // What the provider will count, as it stands now (a held request asks again: a prefix
        // cached meanwhile is predicted on its next try).
        predict::before(self.cfg, self.needs, flow, env);
        let mut taken: Vec<Taken> = Vec::new();
        let mut charges = Vec::new();
        let mut slots = Vec::new();
        let last = self
            .limits
            .iter()
            .enumerate()
            .rposition(|(i, l)| applies(i, l));
        for (i, limit) in self.limits.iter().enumerate() {
            if !applies(i, limit) {
                continue;
            }
            // What was taken is kept only to give it back when a later limit (or the fleet)
            // refuses: without fleet limits, the last limit's take need not be kept.
            let later = self.fleet || Some(i) != last;
            let key_id = flow.limit_keys.get(i).copied().unwrap_or(0);
            let now = env.now();
            // What an expired lease of this worker left goes back in this update.
            let mut unspent = 0;
            if limit.kind == LimitKind::Requests {
                match env.leases.spend((i, key_id), now) {
                    Ok(()) => {
                        // A leased take is given back to the lease: it needs no key.
                        if later {
                            taken.push(Taken {
                                limit: i,
                                key: String::new(),
                                tokens: 1,
                                leased: Some(key_id),
                            });
                        }
                        continue;
                    }
                    Err(left) => unspent = left,
                }
            }
            let key = if holds_slot(limit.kind) {
                keys::slots_key(&limit.name, key_id)
            } else {
                keys::bucket_key(&limit.name, key_id)
            };
            // The read that tells whether the key exists is the first read of the update.
            let Target { key, known, own } = self.existing_or_overflow(i, key, flow.pool, env);
            // What the request takes from a bucket: one request, its token reservation, or
            // nothing (a budget charged after the response only needs a token left).
            let Reserve { amount, firm } = match limit.kind {
                LimitKind::Requests => Reserve { amount: 1, firm: 1 },
                LimitKind::Tokens => reservation(limit, flow),
                LimitKind::InFlight => Reserve { amount: 0, firm: 0 },
            };
            if firm > limit.burst {
                self.give_back(taken, &mut slots, flow.pool, env);
                return Err(Blocked::TooLarge {
                    limit: i,
                    tokens: firm,
                });
            }
            // A request bucket of the key's own, far from empty, lends this worker a lease.
            let may_lease = limit.kind == LimitKind::Requests && own;
            let mut leased = 0;
            let outcome = match limit.kind {
                LimitKind::Requests | LimitKind::Tokens => {
                    let shape = Shape::from(limit);
                    update_bucket(env, &key, known, shape, |b| {
                        if amount == 0 {
                            return (None, (b.check(shape, now, 1), 0));
                        }
                        let stored = b;
                        let b = if unspent > 0 {
                            b.give(shape, now, unspent)
                        } else {
                            b
                        };
                        let (after, take) = b.take(shape, now, amount);
                        if may_lease && take.admitted {
                            let (rest, lease) = after.take(shape, now, lease::LEASE - 1);
                            if lease.admitted && lease.remaining >= lease::FLOOR {
                                return (Some(rest), (take, lease::LEASE - 1));
                            }
                        }
                        ((after != stored).then_some(after), (take, 0))
                    })
                    .map(|u| {
                        let (take, lease) = u.value;
                        leased = lease;
                        if take.admitted {
                            Ok(())
                        } else {
                            Err(Blocked::Bucket {
                                limit: i,
                                wait_ms: take.wait_ms,
                                remaining: take.remaining,
                            })
                        }
                    })
                }
                LimitKind::InFlight => {
                    let epoch = inflight::epoch_of(now, limit.slot_lease_ms);
                    let cap = limit.per_window;
                    store::modify(env.store, &key, known, None, |s: Option<Slots>| {
                        match s.unwrap_or_default().acquire(epoch, cap) {
                            Some((after, slot)) => (Some(after), Some(slot)),
                            None => (None, None),
                        }
                    })
                    .map(|u| match u.value {
                        Some(slot) => {
                            slots.push(HeldSlot {
                                limit: i,
                                key: key.clone(),
                                slot,
                            });
                            Ok(())
                        }
                        None => Err(Blocked::InFlight { limit: i }),
                    })
                }
            };
            let took = matches!(outcome, Ok(Ok(())));
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(blocked)) => {
                    self.give_back(taken, &mut slots, flow.pool, env);
                    return Err(blocked);
                }
                // A concurrency cap stays exact: a slot that could not be counted is not
                // taken, and the request waits (held) or is answered as if the cap were full.
                Err(e) if limit.kind == LimitKind::InFlight => {
                    keyspace::store_failed(flow.pool, &key, &e, env);
                    self.give_back(taken, &mut slots, flow.pool, env);
                    return Err(Blocked::InFlight { limit: i });
                }
                Err(e) => keyspace::store_failed(flow.pool, &key, &e, env),
            }
            if leased > 0 {
                env.leases.put((i, key_id), leased, now);
            }
            // A give-up admitted without taking: nothing to give back, nothing reserved.
            let taken_amount = if took { amount } else { 0 };
            if later && taken_amount > 0 && limit.kind != LimitKind::InFlight {
                taken.push(Taken {
                    limit: i,
                    key: key.clone(),
                    tokens: taken_amount,
                    leased: None,
                });
            }
            if limit.kind == LimitKind::Tokens {
                charges.push(Charge {
                    limit: i,
                    key,
                    reserved: taken_amount,
                });
            }
        }
        if !slots.is_empty() {
            in_flight_moved(env, flow.pool, slots.len() as i64);
        }
        flow.charges.append(&mut charges);
        flow.slots.append(&mut slots);
        if self.fleet {
            flow.fleet_mut().taken.append(&mut taken);
        }
        Ok(())
    }

    /// What the flow takes of limit `limit` when admitted: one request, its reservation of a
    /// token budget (0 when it is charged after the response), nothing of a cap's rate.
    pub fn cost(&self, limit: usize, flow: &Flow) -> u64 {
        match self.limits.get(limit) {
            Some(l) if l.kind == LimitKind::Requests => 1,
            Some(l) if l.kind == LimitKind::Tokens => reservation(l, flow).amount,
            _ => 0,
        }
    }

    /// What the flow reserved of each token dimension (the most of the limits counting it):
    /// what a request like it needs of the provider's own limits.
    pub(crate) fn need(&self, flow: &Flow) -> Need {
        let mut need = Need::default();
        for c in flow.charges.iter().filter(|c| c.reserved > 0) {
            let slot = match self.limits[c.limit].counts {
                Counts::Tokens => &mut need.tokens,
                Counts::InputTokens => &mut need.input_tokens,
                Counts::OutputTokens => &mut need.output_tokens,
            };
            *slot = (*slot).max(Some(c.reserved));
        }
        need
    }

    /// Whether no `max_in_flight` cap of the flow is full, read-only (request buckets are the
    /// tenant's own limit wherever the request goes: not looked at).
    pub(crate) fn caps_have_room(&self, flow: &Flow, env: &mut Env) -> bool {
        let now = env.now();
        self.limits.iter().enumerate().all(|(i, l)| {
            if !holds_slot(l.kind) {
                return true;
            }
            let key_id = flow.limit_keys.get(i).copied().unwrap_or(0);
            let epoch = inflight::epoch_of(now, l.slot_lease_ms);
            match env.store.get(&keys::slots_key(&l.name, key_id)) {
                Ok(Some((bytes, _))) => {
                    Slots::decode(&bytes).map_or(true, |s| s.at(epoch).total() < l.per_window)
                }
                _ => true,
            }
        })
    }

    /// `key` and its value when it exists, or `key` when `max_keys` has room for it; past
    /// `max_keys`, the limit's overflow key.
    fn existing_or_overflow(
        &self,
        limit: usize,
        key: String,
        pool: usize,
        env: &mut Env,
    ) -> Target {
        match env.store.get(&key) {
            Ok(Some(known)) => Target {
                key,
                known: Some(known),
                own: true,
            },
            _ if keyspace::admit_new_key(self.max_keys, keys::BUCKET_KEY_COUNT, pool, env) => {
                Target {
                    key,
                    known: None,
                    own: true,
                }
            }
            _ => Target {
                key: keys::overflow_bucket_key(&self.limits[limit].name),
                known: None,
                own: false,
            },
        }
    }

    fn give_back(&self, taken: Vec<Taken>, slots: &mut Vec<HeldSlot>, pool: usize, env: &mut Env) {
        for t in taken {
            if let Some(key_id) = t.leased {
                env.leases.give((t.limit, key_id));
                continue;
            }
            let now = env.now();
            self.adjust(t.limit, &t.key, pool, env, |b, shape| {
                b.give(shape, now, t.tokens)
            });
        }
        for s in slots.drain(..) {
            self.release_slot(&s, pool, env);
        }
    }

    /// Give back every slot the flow holds (its stream ended).
    pub fn release_slots(&self, flow: &mut Flow, env: &mut Env) {
        let slots = std::mem::take(&mut flow.slots);
        if slots.is_empty() {
            return;
        }
        let n = slots.len() as i64;
        for s in &slots {
            self.release_slot(s, flow.pool, env);
        }
        in_flight_moved(env, flow.pool, -n);
    }

    fn release_slot(&self, held: &HeldSlot, pool: usize, env: &mut Env) {
        let epoch = inflight::epoch_of(env.now(), self.limits[held.limit].slot_lease_ms);
        keyspace::modify(env, pool, &held.key, None, None, |s: Option<Slots>| {
            (s.map(|s| s.release(held.slot, epoch)), ())
        });
    }

    /// Settle the flow's token budgets with the usage its response reported, each counted as
    /// its provider counts its dimension (`counting`): a reservation is replaced by that count
    /// (the difference given back, or charged: an answer longer than predicted is charged in
    /// full) unless it settles as reserved; a budget charged after the response is charged it
    /// all. Once: the flow owes nothing afterwards. Then the predictions learn from it.
    pub fn on_usage(&self, flow: &mut Flow, usage: &Usage, env: &mut Env) {
        self.settle(flow, Some(usage), env);
        predict::learn(self.cfg, self.needs, flow, usage, env);
    }

    /// Give every reservation back in full: the provider answered an error of its own and
    /// counted nothing.
    pub fn refund(&self, flow: &mut Flow, env: &mut Env) {
        self.settle(flow, None, env);
    }

    /// What limit `limit` settles the flow's charge of `reserved` at: 0 for a refund, the
    /// reservation where it settles as reserved (or the usage says nothing it counts), else
    /// what the provider counted.
    fn settled(&self, limit: usize, flow: &Flow, usage: Option<&Usage>, reserved: u64) -> u64 {
        let l = &self.limits[limit];
        let Some(usage) = usage else { return 0 };
        if settle_of(l, flow) == Settle::Reservation && l.reserve && reserved > 0 {
            return reserved;
        }
        counting::counted(flow.dialect, usage, l.count_cache_reads)
            .map_or(reserved, |c| c.of(l.counts))
    }

    fn settle(&self, flow: &mut Flow, usage: Option<&Usage>, env: &mut Env) {
        let now = env.now();
        // The fleet's budgets settle by the same rule, at the stream's end (`fleet`).
        if flow.fleet_charged() {
            let mut charges = std::mem::take(&mut flow.fleet_mut().charges);
            for c in charges.iter_mut() {
                c.settled = Some(self.settled(c.limit, flow, usage, c.amount));
            }
            flow.fleet_mut().charges = charges;
        }
        for Charge {
            limit: i,
            key,
            reserved,
        } in std::mem::take(&mut flow.charges)
        {
            let tokens = self.settled(i, flow, usage, reserved);
            if tokens == reserved {
                continue;
            }
            self.adjust(i, &key, flow.pool, env, |b, shape| {
                if tokens >= reserved {
                    b.charge(shape, now, tokens - reserved)
                } else {
                    b.give(shape, now, reserved - tokens)
                }
            });
        }
    }

    /// Move the bucket of limit `limit` at `key` by `f` (a give-back, a settle), counting a
    /// failed update against `pool`.
    fn adjust(
        &self,
        limit: usize,
        key: &str,
        pool: usize,
        env: &mut Env,
        f: impl Fn(Bucket, Shape) -> Bucket,
    ) {
        let shape = Shape::from(&self.limits[limit]);
        if let Err(e) = update_bucket(env, key, None, shape, |b| (Some(f(b, shape)), ())) {
            keyspace::store_failed(pool, key, &e, env);
        }
    }
}

/// What a reserving budget takes for this request (`counting::reservation`): nothing for a
/// budget charged after the response, or a request whose body was not read.
pub(crate) fn reservation(limit: &Limit, flow: &Flow) -> Reserve {
    match flow.estimate {
        Some(est) if limit.reserve => counting::reservation(
            limit,
            settle_of(limit, flow),
            flow.dialect,
            &est,
            &flow.prediction(),
        ),
        _ => Reserve { amount: 0, firm: 0 },
    }
}

/// How the limit settles this flow's reservation: `auto` counts as the provider behind it
/// does (the flow's dialect is that of the pool it is governed as, so a reservation and its
/// settle agree).
fn settle_of(limit: &Limit, flow: &Flow) -> Settle {
    match limit.settle {
        Settle::Auto => match flow.dialect {
            Dialect::OpenAi | Dialect::AzureOpenAi => Settle::Reservation,
            _ => Settle::Usage,
        },
        s => s,
    }
}

/// Read-modify-write the token bucket at `key`, created full when missing (a stored value
/// that is not a bucket reads as a full one). `step` returns the bucket to write, if any.
fn update_bucket<T>(
    env: &Env,
    key: &str,
    known: Option<(Vec<u8>, u32)>,
    shape: Shape,
    mut step: impl FnMut(Bucket) -> (Option<Bucket>, T),
) -> Result<store::Updated<T>, UpdateError> {
    let now = env.now();
    let full = Bucket::full(shape, now);
    store::modify(env.store, key, known, Some(&full), |b: Option<Bucket>| {
        step(b.unwrap_or(full))
    })
}

/// Does a limit of this kind hold a slot for the whole stream?
pub(crate) fn holds_slot(kind: LimitKind) -> bool {
    kind == LimitKind::InFlight
}

/// The in-flight gauge moves with slots taken and given back.
pub(crate) fn in_flight_moved(env: &mut Env, pool: usize, delta: i64) {
    env.metrics.add(pool, Gauge::InFlight, delta);
}
