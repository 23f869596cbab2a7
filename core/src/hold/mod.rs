//! What one worker does with requests that cannot go now: hold them (nothing upstream, nothing
//! to the client) while the wait is short enough, and let them go as the gates open, in the
//! order `fair` keeps. A pure state machine driven by `now` and events; the host feeds it
//! requests, ticks and departures and applies what it returns.
//!
//! Queues are per (pool, account): a new request never overtakes the held ones of its (pool,
//! account) on this worker, and they leave in the queue's order (arrival order without
//! `hold.fair_key` and `hold.classes`). Across workers, the shared cooldown record's pace hands
//! out releases: each worker's share goes in its own queue's order.

mod board;
mod fair;

use crate::blocked::Blocked;
use crate::config::LimitKey;
use crate::effects::TICK_MS;
use crate::env::Env;
use crate::keys;
use crate::keyspace;
use crate::metrics::{ClassStat, Counter, Gauge, Histogram, Write};
use crate::policy::Governor;
use crate::reply::LocalReply;
use crate::request::Flow;
use board::Board;
pub use fair::Held;
use fair::{Queue, Wait, SCALE};
use std::collections::HashMap;

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

/// The fair-key value that distinct values past `max_keys` share.
const OVERFLOW: u64 = u64::MAX;

pub struct Holds {
    queues: HashMap<QueueKey, Queue>,
    held: usize,
    /// Held now, per hold class.
    by_class: Vec<usize>,
    /// This worker on the boards it shares with the others (`board`).
    me: u64,
}

impl Holds {
    /// The holds of a worker; `entropy` tells it from the others (with a count of the workers
    /// of this process, for hosts whose workers draw the same).
    pub fn new(entropy: u64) -> Holds {
        static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Holds {
            queues: HashMap::new(),
            held: 0,
            by_class: Vec::new(),
            me: entropy ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        }
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
        let queued = match self.queues.is_empty() {
            true => None,
            false => self.queues.get(&key),
        };
        if let Some(queue) = queued {
            // Held requests of this (pool, account) go first: it joins them if its turn comes
            // in time, else it is told when its turn would come.
            let now = env.now();
            let value = self.value_of(gov, &flow, env);
            let class = flow.hold_class;
            if let Some(wait) = queue.wait_for(class, value) {
                let blocked = wait.at(now);
                let pos = queue.len_of(class, value);
                let turn = turn(gov, queue, &flow, (class, value, pos), blocked, now);
                if !self.may_hold(gov, &turn.told, turn.expect_ms, &mut flow, now) {
                    let told = self.shed(&key, class, turn, now);
                    let reply = gov.replies().reply_for(&flow, &told, env);
                    return Outcome::Reply(flow, reply);
                }
                return self.hold(gov, flow, (blocked, false), id, value, env);
            }
        }
        match admission.admit(&mut flow, env) {
            Ok(()) => Outcome::Go(flow),
            Err(blocked) => self.wait(gov, flow, blocked, id, env),
        }
    }

    /// A request that cannot go now (a local gate refused it, or the fleet's service did):
    /// held if it may be, else answered. One that was held before keeps its place at the head
    /// of its value.
    pub fn wait(
        &mut self,
        gov: &Governor,
        mut flow: Flow,
        blocked: Blocked,
        id: u32,
        env: &mut Env,
    ) -> Outcome {
        if self.may_hold(gov, &blocked, blocked.wait_ms(), &mut flow, env.now()) {
            let value = self.value_of(gov, &flow, env);
            return self.hold(gov, flow, (blocked, true), id, value, env);
        }
        let reply = gov.replies().reply_for(&flow, &blocked, env);
        Outcome::Reply(flow, reply)
    }

    /// What a request that cannot wait for its turn is told: its turn, and no sooner than one
    /// release after the last one of its class told so (who come back one after another, and
    /// not all into the same instant).
    fn shed(&mut self, key: &QueueKey, class: usize, turn: Turn, now: u64) -> Blocked {
        let (Some(queue), Some(told)) = (self.queues.get_mut(key), turn.told_ms) else {
            return turn.told;
        };
        let at = now.saturating_add(told);
        let next = queue.promised(class).saturating_add(turn.step_ms);
        let later = next.saturating_sub(at);
        queue.promise(class, at + later);
        turn.told.later(later)
    }

    /// Whether a request blocked so, expecting to wait `expect_ms` (None: until an event), may
    /// be held: holding is on for it, there is room (on this worker, and in its class), the
    /// wait ends before its hold must, and waiting can help.
    fn may_hold(
        &self,
        gov: &Governor,
        blocked: &Blocked,
        expect_ms: Option<u64>,
        flow: &mut Flow,
        now: u64,
    ) -> bool {
        let hold = &gov.cfg.hold;
        let class = flow.hold_class;
        let in_class = self.by_class.get(class).copied().unwrap_or(0) as u64;
        let room = (self.held as u64) < hold.max_held && in_class < hold.max_held_of(class);
        let until = flow.hold.fix(|| now);
        let fits = expect_ms.map_or(true, |w| now.saturating_add(w) <= until);
        until > now && room && fits && blocked.holdable()
    }

    /// The flow's `hold.fair_key` value, or the overflow value once this worker holds
    /// `max_keys` distinct values (counted as other keys past the bound are).
    fn value_of(&self, gov: &Governor, flow: &Flow, env: &mut Env) -> u64 {
        if gov.cfg.hold.fair_key.is_none() {
            return 0;
        }
        let id = gov.pools().fair_value(flow);
        let queue = self.queues.get(&queue_key(flow));
        if queue.is_some_and(|q| q.has_value(flow.hold_class, id)) {
            return id;
        }
        let values: usize = self.queues.values().map(Queue::values).sum();
        if (values as u64) < gov.cfg.max_keys {
            return id;
        }
        env.metrics.count(flow.home_pool, Counter::OverflowKeys);
        OVERFLOW
    }

    /// Hold `flow`, blocked so (`refused`: the gates just said so, which is news for its
    /// queue), as value `value` of its class.
    fn hold(
        &mut self,
        gov: &Governor,
        mut flow: Flow,
        (blocked, refused): (Blocked, bool),
        id: u32,
        value: u64,
        env: &mut Env,
    ) -> Outcome {
        let now = env.now();
        // Held before (released, then refused by the fleet): it keeps its place and its time.
        let before = flow.held_ms.take();
        let class = flow.hold_class;
        if before.is_none() {
            count(gov, &flow, Counter::Held, ClassStat::Held, env);
            if gov.cfg.hold.classes.len() > 1 {
                let limit = gov.cfg.hold.max_ms_of(class);
                let write = Write::Set(limit);
                let stat = ClassStat::HoldLimitMs;
                env.metrics.class(flow.home_pool, class, stat, write);
            }
        }
        moved(gov, &flow, 1, env);
        self.held += 1;
        if self.by_class.len() <= class {
            self.by_class.resize(class + 1, 0);
        }
        self.by_class[class] += 1;
        let weight = gov.cfg.hold.classes.get(class).map_or(1, |c| c.weight);
        let queue = self.queues.entry(queue_key(&flow)).or_default();
        let held = Held {
            id,
            since_ms: now.saturating_sub(before.unwrap_or(0)),
            blocked,
            blocked_at_ms: now,
            flow,
        };
        let place = queue.push(held, class, weight, value, before.is_some());
        if refused {
            let wait = Wait::new(blocked, now);
            match shared(gov, &blocked) {
                true => queue.wait = Some(wait),
                false => queue.hold_value(place, wait),
            }
        }
        Outcome::Held
    }

    /// Ask the gates again for the requests whose turn it is, and answer requests whose wait
    /// outgrew their limit. Returns what became of each request that left, in order.
    pub fn tick(&mut self, gov: &Governor, env: &mut Env) -> Vec<(u32, Outcome)> {
        let now = env.now();
        let mut out = Vec::new();
        let me = self.me;
        for (key, queue) in self.queues.iter_mut() {
            let board = board_key(gov, key, env);
            let board = board.as_deref().map(|b| (b, key.0, me));
            release(gov, queue, board, now, env, &mut out);
            expire(gov, queue, now, env, &mut out);
        }
        self.queues.retain(|_, q| !q.is_empty());
        for (_, outcome) in &out {
            if let Outcome::Go(flow) | Outcome::Reply(flow, _) = outcome {
                self.left(flow.hold_class);
            }
        }
        out
    }

    fn left(&mut self, class: usize) {
        self.held = self.held.saturating_sub(1);
        if let Some(n) = self.by_class.get_mut(class) {
            *n = n.saturating_sub(1);
        }
    }

    /// When a tick next has something to do: the earliest check of a wait that stops a queue
    /// or a value, or deadline of anyone held. None when nothing is held.
    pub fn next_due_ms(&self) -> Option<u64> {
        self.queues
            .values()
            .flat_map(|q| {
                let deadlines = q.places().map(|(_, h)| h.flow.hold.until_ms());
                q.next_check_ms().into_iter().chain(deadlines)
            })
            .min()
    }

    /// Whether a request governed as `pool`'s `account` is held here.
    pub fn queued_for(&self, pool: usize, account: u64) -> bool {
        self.queues
            .values()
            .flat_map(|q| q.places())
            .any(|(_, h)| h.flow.pool == pool && h.flow.account == account)
    }

    /// The client went away (or the stream was reset) while held: forget it.
    pub fn forget(&mut self, gov: &Governor, id: u32, env: &mut Env) -> Option<Flow> {
        let (key, place) = self.queues.iter().find_map(|(key, q)| {
            let (p, _) = q.places().find(|(_, h)| h.id == id)?;
            Some((*key, p))
        })?;
        let queue = self.queues.get_mut(&key)?;
        let h = queue.take(place)?;
        if queue.is_empty() {
            self.queues.remove(&key);
        }
        self.left(h.flow.hold_class);
        moved(gov, &h.flow, -1, env);
        Some(h.flow)
    }
}

/// Whether a gate that refused stops every request of the (pool, account) (its cooldown, its
/// pace, its quota, a limit keyed by account or pool), rather than the fair-key value of the
/// refused one (a limit keyed by a header or model: the next value may have room).
fn shared(gov: &Governor, b: &Blocked) -> bool {
    match b.limit().and_then(|l| gov.cfg.limits.get(l)) {
        Some(l) => matches!(l.key, LimitKey::Account | LimitKey::Pool),
        None => true,
    }
}

/// The board of the (pool, account) of `key` (`board`), when turns are shared (a fair key or
/// classes) and the key budget admits it.
fn board_key(gov: &Governor, (pool, account): &QueueKey, env: &mut Env) -> Option<String> {
    let hold = &gov.cfg.hold;
    if hold.fair_key.is_none() && hold.classes.len() < 2 {
        return None;
    }
    let key = keys::board_key(&gov.cfg.pools.get(*pool)?.name, *account);
    let max = gov.cfg.max_keys;
    keyspace::key_exists_or_admit(max, &key, keys::BOARD_KEY_COUNT, *pool, env).then_some(key)
}

/// The seat of a value of a class on the board.
fn seat(class: usize, value: u64) -> u64 {
    value ^ (class as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Let the queue's requests go in turn while the gates let them: a refusal of the whole (pool,
/// account) stops the queue, one of a value's own limit stops that value. With a `board`, the
/// values free to go are said to wait, and one that had more service than a value waiting on
/// another worker leaves the release to that worker.
fn release(
    gov: &Governor,
    q: &mut Queue,
    board: Option<(&str, usize, u64)>,
    now: u64,
    env: &mut Env,
    out: &mut Vec<(u32, Outcome)>,
) {
    let admission = gov.admission();
    if let Some((key, pool, me)) = board {
        let seats: Vec<u64> = q.ready(now).into_iter().map(|(c, v)| seat(c, v)).collect();
        keyspace::modify(env, pool, key, None, None, |b: Option<Board>| {
            let b = b.unwrap_or_default();
            let next = b.seen(&seats, me, now);
            ((next != b).then_some(next), ())
        });
    }
    loop {
        let turns = board.and_then(|(key, ..)| read_board(key, env));
        let next = match turns {
            Some(b) => q.next_where(now, |c, v| b.may_go(seat(c, v), now)),
            None => q.next(now),
        };
        let Some(p) = next else {
            break;
        };
        let class = q.class_at(p);
        let value = q.value_at(p);
        let Some(head) = q.get_mut(p) else {
            break;
        };
        let fleet_refused = matches!(
            head.blocked,
            Blocked::Fleet { .. } | Blocked::Turn { .. } | Blocked::Slot { .. }
        );
        match admission.admit(&mut head.flow, env) {
            Ok(()) => {
                // A request costs its turn 1, or its reservation when a token budget held it.
                let cost = admission.cost_at(&head.blocked, &head.flow);
                let paced = head.flow.released.is_some();
                if let Some(h) = q.release(p, cost, now) {
                    out.push(released(gov, h, now, env));
                }
                if let Some((key, pool, me)) = board {
                    let weight = gov.cfg.hold.classes.get(class).map_or(1, |c| c.weight);
                    let service = cost.max(1).saturating_mul(SCALE) / weight.max(1);
                    let id = seat(class, value);
                    let gone = q.len_of(class, value) == 0;
                    keyspace::modify(env, pool, key, None, None, |b: Option<Board>| {
                        (b.map(|b| b.served(id, service, gone.then_some(me))), ())
                    });
                }
                // Only the fleet knows whether its budget has room again: one request asks
                // it, the rest wait for a tick after its answer. And one release of the shared
                // pace per tick: every worker holding requests of this (pool, account) takes
                // its share of a round in turn, each in its own queue's order (the first to
                // tick took the whole round, and a worker's held requests waited rounds; a
                // native worker, ticked at once after the answer that opened a round, took
                // nearly all of them).
                if paced {
                    let next = Blocked::Paced {
                        retry_in_ms: TICK_MS,
                    };
                    q.wait = Some(Wait::until(next, now, now.saturating_add(TICK_MS)));
                }
                if fleet_refused || paced {
                    break;
                }
            }
            Err(b) if !b.holdable() => {
                // Quota exhausted meanwhile, or too large: waiting cannot help.
                if let Some(mut h) = q.take(p) {
                    h.blocked = b;
                    h.blocked_at_ms = now;
                    out.push(answered(gov, h, None, now, env));
                }
            }
            Err(b) => {
                head.blocked = b;
                head.blocked_at_ms = now;
                let wait = Wait::new(b, now);
                if shared(gov, &b) {
                    q.wait = Some(wait);
                    break;
                }
                q.hold_value(p, wait);
            }
        }
    }
}

fn read_board(key: &str, env: &Env) -> Option<Board> {
    let (bytes, _) = env.store.get(key).ok().flatten()?;
    crate::store::Record::from_bytes(&bytes)
}

/// Answer everyone whose limit passed, or whose known wait outgrows its limit, with the time
/// until its turn.
fn expire(gov: &Governor, q: &mut Queue, now: u64, env: &mut Env, out: &mut Vec<(u32, Outcome)>) {
    let leaving: Vec<(u32, Option<Blocked>)> = q
        .places()
        .filter_map(|(p, h)| {
            let until = h.flow.hold.until_ms();
            let wait = q.wait_at(p).map(|w| w.at(now));
            let outgrown = wait
                .and_then(|w| w.wait_ms())
                .is_some_and(|w| now.saturating_add(w) > until);
            if now < until && !outgrown {
                return None;
            }
            let at = (h.flow.hold_class, q.value_at(p), p.pos);
            let turn = wait.map(|w| turn(gov, q, &h.flow, at, w, now).told);
            Some((h.id, turn))
        })
        .collect();
    if leaving.is_empty() {
        return;
    }
    let gone = q.remove_where(|h| leaving.iter().any(|(id, _)| *id == h.id));
    for h in gone {
        let turn = leaving.iter().find(|(id, _)| *id == h.id).and_then(|l| l.1);
        out.push(answered(gov, h, turn, now, env));
    }
}

/// When the turn of a request comes: what to tell it, how long it waits at least (None: until
/// an event, as for a full cap, or the pace's next answer) and how long one more release takes.
struct Turn {
    told: Blocked,
    /// The wait `told` says, when it says one.
    told_ms: Option<u64>,
    expect_ms: Option<u64>,
    step_ms: u64,
}

/// The turn of a request (of class, value, at its place in its value): the wait of the gate,
/// then the releases that go before it, at the rate the gate refills (a bucket: known, so a
/// request that cannot wait that long is answered at once), or at the pace this queue's
/// releases came at lately (what it is told; none seen yet: the gate's wait alone). Nothing
/// foretells the pace's next releases: behind it, only the gate's own wait is sure.
fn turn(
    gov: &Governor,
    q: &Queue,
    flow: &Flow,
    (class, value, pos): (usize, u64, usize),
    blocked: Blocked,
    now: u64,
) -> Turn {
    let admission = gov.admission();
    let own = admission.cost_at(&blocked, flow);
    let weight = gov.cfg.hold.classes.get(class).map_or(1, |c| c.weight);
    let ahead = q.ahead((class, weight), value, pos, own.max(1));
    let count = ahead.mine.len() as u64 + ahead.others;
    if let Blocked::Bucket { .. } = blocked {
        // The gate's wait is the first one's: then the rest of those before it, and its own.
        let cost = |h: &Held| admission.cost_at(&blocked, &h.flow);
        let mine: u64 = ahead.mine.iter().map(|h| cost(h)).sum();
        let first = q.next(now).and_then(|p| q.get(p)).map_or(own, cost);
        let tokens = match count {
            0 => 0,
            _ => (mine + ahead.others * own + own).saturating_sub(first),
        };
        let told = admission.later_by(blocked, tokens);
        let step_ms = admission.later_by(blocked, own).wait_ms().unwrap_or(0);
        let step_ms = step_ms.saturating_sub(blocked.wait_ms().unwrap_or(0));
        return Turn {
            told,
            told_ms: told.wait_ms(),
            expect_ms: told.wait_ms(),
            step_ms,
        };
    }
    let ms = q.ms_per_release(now);
    let extra = count.saturating_mul(ms.unwrap_or(0));
    Turn {
        told: blocked.later(extra),
        told_ms: Some(blocked.wait_ms().unwrap_or(0).saturating_add(extra)),
        expect_ms: blocked.wait_ms(),
        step_ms: ms.unwrap_or(0),
    }
}

/// Count a request of the hold, on its home pool and, with classes, on its class.
fn count(gov: &Governor, flow: &Flow, c: Counter, s: ClassStat, env: &mut Env) {
    env.metrics.count(flow.home_pool, c);
    if gov.cfg.hold.classes.len() > 1 {
        env.metrics
            .class(flow.home_pool, flow.hold_class, s, Write::Count);
    }
}

/// Move `held_requests` by `delta`, on the home pool and, with classes, on the class.
fn moved(gov: &Governor, flow: &Flow, delta: i64, env: &mut Env) {
    env.metrics.add(flow.home_pool, Gauge::HeldRequests, delta);
    if gov.cfg.hold.classes.len() > 1 {
        let (pool, class) = (flow.home_pool, flow.hold_class);
        env.metrics
            .class(pool, class, ClassStat::HeldRequests, Write::Move(delta));
    }
}

/// The bookkeeping of a request leaving the hold, either way: its held time, on its home pool
/// (and class).
fn leave(gov: &Governor, h: &mut Held, now: u64, c: Counter, s: ClassStat, env: &mut Env) {
    let held_ms = now.saturating_sub(h.since_ms);
    h.flow.held_ms = Some(held_ms);
    let pool = h.flow.home_pool;
    count(gov, &h.flow, c, s, env);
    env.metrics.histogram(pool, Histogram::HoldMs, held_ms);
    if gov.cfg.hold.classes.len() > 1 {
        let class = h.flow.hold_class;
        env.metrics
            .class(pool, class, ClassStat::HoldMs, Write::Record(held_ms));
    }
    moved(gov, &h.flow, -1, env);
}

fn released(gov: &Governor, mut h: Held, now: u64, env: &mut Env) -> (u32, Outcome) {
    leave(
        gov,
        &mut h,
        now,
        Counter::HoldReleased,
        ClassStat::Released,
        env,
    );
    (h.id, Outcome::Go(h.flow))
}

/// Answer a held request locally, from why it waits: `turn` when its place in the queue is
/// known, else its own wait aged to now.
fn answered(
    gov: &Governor,
    mut h: Held,
    turn: Option<Blocked>,
    now: u64,
    env: &mut Env,
) -> (u32, Outcome) {
    leave(
        gov,
        &mut h,
        now,
        Counter::HoldExpired,
        ClassStat::Expired,
        env,
    );
    let blocked = turn.unwrap_or_else(|| h.blocked.aged(now - h.blocked_at_ms));
    let reply = gov.replies().reply_for(&h.flow, &blocked, env);
    (h.id, Outcome::Reply(h.flow, reply))
}
