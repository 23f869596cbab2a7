//! What one worker does with requests that cannot go now: hold them (nothing upstream, nothing
//! to the client) while the wait is short enough, and let them go in arrival order as the
//! gates open. A pure state machine driven by `now` and events; the host feeds it requests,
//! ticks and departures and applies what it returns.
//!
//! Queues are per (pool, account): held requests of one (pool, account) leave in arrival
//! order, and a new request never overtakes them on this worker. Across workers, the shared
//! cooldown record's pace hands out releases one round at a time.

use crate::blocked::Blocked;
use crate::env::Env;
use crate::metrics::{Counter, Gauge, Histogram};
use crate::policy::Governor;
use crate::reply::LocalReply;
use crate::request::Flow;
use std::collections::{HashMap, VecDeque};

/// A request being held.
#[derive(Debug)]
pub struct Held {
    pub id: u32,
    pub flow: Flow,
    pub since_ms: u64,
    /// Why it waits, as of `blocked_at_ms`.
    pub blocked: Blocked,
    pub blocked_at_ms: u64,
    /// The gates are not asked again before this.
    pub next_check_ms: u64,
}

/// What became of a request: of one handed to `Holds::request`, and (never `Held`) of a held
/// one a tick let go.
#[derive(Debug)]
pub enum Outcome {
    /// It passed every gate of this Envoy (cooldowns, pace, local limits): it goes, once the
    /// fleet's limits admit it too when it has any.
    Go(Flow),
    /// It is held: keep it paused.
    Held,
    /// Answer it locally now.
    Reply(Flow, LocalReply),
}

type QueueKey = (usize, u64);

/// Requests queue, and are counted in the hold stats, by the (pool, account) they came as:
/// the pool they matched and the client's credential, whichever pool they wait on or go to.
fn queue_key(flow: &Flow) -> QueueKey {
    (flow.home_pool, flow.client_account)
}

#[derive(Default)]
pub struct Holds {
    queues: HashMap<QueueKey, VecDeque<Held>>,
    held: usize,
}

impl Holds {
    pub fn new() -> Holds {
        Holds::default()
    }

    /// Requests held now on this worker.
    pub fn len(&self) -> usize {
        self.held
    }

    pub fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// A new request (it may be held until its `flow.hold` deadline).
    pub fn request(&mut self, gov: &Governor, mut flow: Flow, id: u32, env: &mut Env) -> Outcome {
        let admission = gov.admission();
        admission.on_arrival(&flow, env);
        let key = queue_key(&flow);
        let queued = if self.queues.is_empty() {
            None
        } else {
            self.queues.get(&key).and_then(|q| q.back())
        };
        if let Some(last) = queued {
            // Held requests of this (pool, account) go first: wait behind them. Answered,
            // it is told its turn: after what the queue behind the head takes, and its own.
            let blocked = last.blocked.aged(env.now() - last.blocked_at_ms);
            if !self.may_hold(gov, &blocked, &mut flow, env.now()) {
                let queue = self.queues.get(&key).into_iter().flatten().skip(1);
                let tokens = queue
                    .map(|h| admission.cost_at(&blocked, &h.flow))
                    .sum::<u64>()
                    + admission.cost_at(&blocked, &flow);
                let turn = admission.later_by(blocked, tokens);
                let reply = gov.replies().reply_for(&flow, &turn, env);
                return Outcome::Reply(flow, reply);
            }
            return self.hold(flow, blocked, id, env);
        }
        match admission.admit(&mut flow, env) {
            Ok(()) => Outcome::Go(flow),
            Err(blocked) => self.wait(gov, flow, blocked, id, env),
        }
    }

    /// A request that cannot go now (a local gate refused it, or the fleet's service did):
    /// held if it may be, else answered. One that was held before keeps its place at the head
    /// of its queue.
    pub fn wait(
        &mut self,
        gov: &Governor,
        mut flow: Flow,
        blocked: Blocked,
        id: u32,
        env: &mut Env,
    ) -> Outcome {
        if self.may_hold(gov, &blocked, &mut flow, env.now()) {
            return self.hold(flow, blocked, id, env);
        }
        let reply = gov.replies().reply_for(&flow, &blocked, env);
        Outcome::Reply(flow, reply)
    }

    /// Whether a request blocked so may be held: holding is on for it, there is room, the wait
    /// is known to end before its hold must (or ends with an event), and waiting can help.
    fn may_hold(&self, gov: &Governor, blocked: &Blocked, flow: &mut Flow, now: u64) -> bool {
        let room = (self.held as u64) < gov.cfg.hold.max_held;
        let until = flow.hold.fix(|| now);
        let fits = blocked
            .wait_ms()
            .map_or(true, |w| now.saturating_add(w) <= until);
        until > now && room && fits && blocked.holdable()
    }

    fn hold(&mut self, mut flow: Flow, blocked: Blocked, id: u32, env: &mut Env) -> Outcome {
        let now = env.now();
        // Held before (released, then refused by the fleet): it keeps its place and its time.
        let before = flow.held_ms.take();
        if before.is_none() {
            env.metrics.count(flow.home_pool, Counter::Held);
        }
        env.metrics.add(flow.home_pool, Gauge::HeldRequests, 1);
        self.held += 1;
        let held = Held {
            id,
            since_ms: now.saturating_sub(before.unwrap_or(0)),
            blocked,
            blocked_at_ms: now,
            next_check_ms: now.saturating_add(blocked.recheck_in_ms()),
            flow,
        };
        let queue = self.queues.entry(queue_key(&held.flow)).or_default();
        if before.is_some() {
            queue.push_front(held);
        } else {
            queue.push_back(held);
        }
        Outcome::Held
    }

    /// Ask the gates again for the heads of the queues that are due, and answer requests whose
    /// wait outgrew their limit. Returns what became of each request that left, in order.
    pub fn tick(&mut self, gov: &Governor, env: &mut Env) -> Vec<(u32, Outcome)> {
        let now = env.now();
        let admission = gov.admission();
        let mut out = Vec::new();
        for queue in self.queues.values_mut() {
            // The heads, in arrival order, while the gates let them go.
            let mut known_wait = None;
            while let Some(head) = queue.front_mut() {
                if now < head.next_check_ms && now < head.flow.hold.until_ms() {
                    known_wait = head.blocked.aged(now - head.blocked_at_ms).wait_ms();
                    break;
                }
                let fleet_refused = matches!(
                    head.blocked,
                    Blocked::Fleet { .. } | Blocked::Turn { .. } | Blocked::Slot { .. }
                );
                match admission.admit(&mut head.flow, env) {
                    Ok(()) => {
                        if let Some(h) = queue.pop_front() {
                            out.push(released(h, now, env));
                        }
                        if fleet_refused {
                            // Only the fleet knows whether its budget has room again: one
                            // request asks it, the rest wait for a tick after its answer.
                            break;
                        }
                    }
                    Err(b) if !b.holdable() => {
                        // Quota exhausted meanwhile: waiting cannot help.
                        if let Some(mut h) = queue.pop_front() {
                            h.blocked = b;
                            h.blocked_at_ms = now;
                            out.push(answered(h, None, now, gov, env));
                        }
                    }
                    Err(b) => {
                        head.blocked = b;
                        head.blocked_at_ms = now;
                        head.next_check_ms = now.saturating_add(b.recheck_in_ms());
                        known_wait = b.wait_ms();
                        break;
                    }
                }
            }
            // Everyone whose limit passed, or whose limit the known wait outgrows, is answered
            // now with the time that is left until its turn: the head's wait, then what the
            // requests between the head and it take of the bucket.
            let before = queue.len();
            let mut kept = VecDeque::with_capacity(before);
            let leaves = |h: &Held| {
                let until = h.flow.hold.until_ms();
                now >= until || known_wait.is_some_and(|w| now.saturating_add(w) > until)
            };
            // The turns are counted only when someone behind the head leaves now.
            let head = queue
                .front()
                .map(|h| h.blocked.aged(now - h.blocked_at_ms))
                .filter(|_| queue.iter().skip(1).any(leaves));
            let mut ahead = 0u64;
            for (place, h) in queue.drain(..).enumerate() {
                let turn = match head {
                    Some(head) if place > 0 => {
                        ahead = ahead.saturating_add(admission.cost_at(&head, &h.flow));
                        Some(admission.later_by(head, ahead))
                    }
                    _ => None,
                };
                if leaves(&h) {
                    out.push(answered(h, turn, now, gov, env));
                } else {
                    kept.push_back(h);
                }
            }
            *queue = kept;
        }
        self.queues.retain(|_, q| !q.is_empty());
        self.held = self.queues.values().map(VecDeque::len).sum();
        out
    }

    /// When a tick next has something to do: the earliest gate check of a queue's head, or
    /// deadline of anyone held. None when nothing is held.
    pub fn next_due_ms(&self) -> Option<u64> {
        self.queues
            .values()
            .flat_map(|q| {
                let head = q.front().map(|h| h.next_check_ms);
                head.into_iter()
                    .chain(q.iter().map(|h| h.flow.hold.until_ms()))
            })
            .min()
    }

    /// Whether a request governed as `pool`'s `account` is held here.
    pub fn queued_for(&self, pool: usize, account: u64) -> bool {
        self.queues
            .values()
            .flatten()
            .any(|h| h.flow.pool == pool && h.flow.account == account)
    }

    /// The client went away (or the stream was reset) while held: forget it.
    pub fn forget(&mut self, id: u32, env: &mut Env) -> Option<Flow> {
        let mut found = None;
        for queue in self.queues.values_mut() {
            if let Some(at) = queue.iter().position(|h| h.id == id) {
                found = queue.remove(at);
                break;
            }
        }
        let h = found?;
        self.queues.retain(|_, q| !q.is_empty());
        self.held -= 1;
        env.metrics.add(h.flow.home_pool, Gauge::HeldRequests, -1);
        Some(h.flow)
    }
}

/// The bookkeeping of a request leaving the hold, either way: its held time, on its home pool.
fn leave(h: &mut Held, now: u64, counter: Counter, env: &mut Env) {
    let held_ms = now - h.since_ms;
    h.flow.held_ms = Some(held_ms);
    let pool = h.flow.home_pool;
    env.metrics.count(pool, counter);
    env.metrics.histogram(pool, Histogram::HoldMs, held_ms);
    env.metrics.add(pool, Gauge::HeldRequests, -1);
}

fn released(mut h: Held, now: u64, env: &mut Env) -> (u32, Outcome) {
    leave(&mut h, now, Counter::HoldReleased, env);
    (h.id, Outcome::Go(h.flow))
}

/// Answer a held request locally, from why it waits: `turn` when its place in the queue is
/// known, else its own wait aged to now.
fn answered(
    mut h: Held,
    turn: Option<Blocked>,
    now: u64,
    gov: &Governor,
    env: &mut Env,
) -> (u32, Outcome) {
    leave(&mut h, now, Counter::HoldExpired, env);
    let blocked = turn.unwrap_or_else(|| h.blocked.aged(now - h.blocked_at_ms));
    let reply = gov.replies().reply_for(&h.flow, &blocked, env);
    (h.id, Outcome::Reply(h.flow, reply))
}
