//! The store-backed side of `cooldown` for one (pool, account): read the record, pass its gate,
//! merge an answer into it.

use crate::classify::Class;
use crate::config::Config;
use crate::cooldown::{self, Answer, CooldownRecord, Gate, Pace, Ticket, Wanted};
use crate::env::Env;
use crate::keys;
use crate::keyspace;
use crate::request::{Flow, Release};
use crate::store::SharedStore;

/// What this Envoy knows of a (pool, account) itself (`fleet::watch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Here {
    /// The provider said "not now" here: this Envoy marks it.
    Cools,
    /// Paced here (after a cooldown, or while another Envoy cools it): requests ask for the
    /// turn, nothing to check.
    Paces,
    /// Nothing cools or paces it here: check whether another Envoy cools it.
    Quiet,
}

/// The cooldowns of a configuration's (pool, account)s, kept in the shared store.
#[derive(Clone, Copy)]
pub struct Cooldowns<'a> {
    cfg: &'a Config,
}

impl<'a> Cooldowns<'a> {
    pub fn new(cfg: &'a Config) -> Cooldowns<'a> {
        Cooldowns { cfg }
    }

    fn key(&self, flow: &Flow) -> String {
        keys::cooldown_key(&self.cfg.pools[flow.pool].name, flow.account)
    }

    /// The record of the flow's (pool, account), if it has one.
    pub fn record(&self, flow: &Flow, env: &Env) -> Option<CooldownRecord> {
        let (bytes, _) = env.store.get(&self.key(flow)).ok().flatten()?;
        CooldownRecord::decode(&bytes)
    }

    /// The gate of `pool`'s `account` at `now` as a request with holding on would meet it,
    /// read-only (None: nothing is recorded).
    fn gate(&self, pool: usize, account: u64, store: &dyn SharedStore, now: u64) -> Option<Gate> {
        let key = keys::cooldown_key(&self.cfg.pools[pool].name, account);
        let (bytes, _) = store.get(&key).ok().flatten()?;
        Some(cooldown::pass(CooldownRecord::decode(&bytes)?, now, true).0)
    }

    /// Until when the provider keeps `pool`'s `account` from more traffic, read-only: cooling,
    /// or paced with no release open (None: it has room, or nothing is recorded).
    pub fn busy_until(
        &self,
        pool: usize,
        account: u64,
        store: &dyn SharedStore,
        now: u64,
    ) -> Option<u64> {
        match self.gate(pool, account, store, now)? {
            Gate::Cooling { remaining_ms, .. } => Some(now + remaining_ms),
            Gate::Paced { retry_in_ms } => Some(now + retry_in_ms),
            Gate::Open | Gate::Released => None,
        }
    }

    /// What this Envoy knows of `pool`'s `account` itself (`fleet::watch`).
    pub fn here(&self, pool: usize, account: u64, store: &dyn SharedStore, now: u64) -> Here {
        match self.gate(pool, account, store, now) {
            Some(Gate::Cooling { .. }) => Here::Cools,
            Some(Gate::Paced { .. } | Gate::Released) => Here::Paces,
            Some(Gate::Open) | None => Here::Quiet,
        }
    }

    /// Another Envoy cools `pool`'s `account` (its marker, `fleet::watch`): unless it cools or
    /// paces here already, pace it here from now, as after a cooldown of no time: one request
    /// at a time asks for its turn (which the Envoy that cools it holds), and the answers of
    /// the one that gets it open the rest.
    pub fn held_elsewhere(&self, pool: usize, account: u64, env: &mut Env) {
        let key = keys::cooldown_key(&self.cfg.pools[pool].name, account);
        let (max_keys, count) = (self.cfg.max_keys, keys::COOLDOWN_KEY_COUNT);
        if !keyspace::key_exists_or_admit(max_keys, &key, count, pool, env) {
            return;
        }
        let now = env.now();
        keyspace::modify(env, pool, &key, None, None, |old| {
            let quiet = old.map_or(true, |r| cooldown::pass(r, now, true).0 == Gate::Open);
            let paced = |r: CooldownRecord| CooldownRecord {
                pace: Pace {
                    active: true,
                    credits: 0,
                    out: 0,
                    last_release_ms: now,
                    ..r.pace
                },
                ..r
            };
            let rec = old.unwrap_or(CooldownRecord::idle(Class::RateLimited));
            (quiet.then(|| paced(rec)), ())
        });
    }

    /// The longest provider time of the episode `pool`'s `account` is in (0: none recorded).
    pub fn spread_ms(&self, pool: usize, account: u64, store: &dyn SharedStore) -> u64 {
        let key = keys::cooldown_key(&self.cfg.pools[pool].name, account);
        let rec = store.get(&key).ok().flatten();
        rec.and_then(|(b, _)| CooldownRecord::decode(&b))
            .map_or(0, |r| u64::from(r.spread_ms))
    }

    /// The cooldown gate: read the record (one copy, the common case writes nothing) and take
    /// a release of the pace when pacing.
    pub fn pass(&self, flow: &mut Flow, env: &mut Env) -> Gate {
        let key = self.key(flow);
        let known = match env.store.get(&key) {
            Ok(Some(v)) => v,
            _ => return Gate::Open,
        };
        let paced = self.cfg.hold.enabled();
        let now = env.now();
        let result = keyspace::modify(env, flow.pool, &key, Some(known), None, |cur| match cur {
            Some(rec) => {
                let (gate, write) = cooldown::pass(rec, now, paced);
                let ticket = write.as_ref().map(Ticket::of);
                (write, (gate, rec.streak, ticket))
            }
            None => (None, (Gate::Open, 0, None)),
        });
        let Some((gate, streak, ticket)) = result else {
            return Gate::Open;
        };
        flow.streak = streak;
        flow.released = ticket
            .filter(|_| gate == Gate::Released)
            .map(|ticket| Release { ticket, at_ms: now });
        gate
    }

    /// A later gate refused after the pace released this request: give the release back.
    pub fn give_back_release(&self, flow: &mut Flow, env: &mut Env) {
        if flow.released.take().is_none() {
            return;
        }
        let key = self.key(flow);
        keyspace::modify(env, flow.pool, &key, None, None, |cur| {
            (cur.map(cooldown::unpass), ())
        });
    }

    /// Consecutive rounds that ended in "not now", counting this answer. Answers that arrive
    /// while a cooldown is running belong to its round; one that arrives after it ended, with
    /// no success since, starts the next round.
    pub fn failed_rounds(&self, flow: &Flow, env: &Env) -> u8 {
        match self.record(flow, env) {
            Some(r) if r.deadline_ms > env.now() => r.streak.max(1),
            Some(r) => r.streak.saturating_add(1),
            None => 1,
        }
    }

    /// How many provider periods clients are told to wait after `rounds` failed rounds.
    pub fn stretch(&self, rounds: u8) -> u64 {
        if self.cfg.retry_after.escalate {
            1u64 << u32::from(rounds.saturating_sub(1).min(10))
        } else {
            1
        }
    }

    /// Report a non-success answer (or none) of a released request to the pace.
    pub fn answer_pace(&self, flow: &mut Flow, answer: Answer, env: &mut Env) {
        let Some(release) = flow.released.take() else {
            return;
        };
        let key = self.key(flow);
        keyspace::modify(env, flow.pool, &key, None, None, |cur| {
            (
                cur.map(|r| cooldown::answered(r, answer, Some(release.ticket))),
                (),
            )
        });
    }

    /// Merge an answer into the flow's (pool, account) record: the cooldown it asks for (if
    /// any), the streak, and what it means for the pace. Returns whether it started or moved
    /// a cooldown deadline.
    pub fn cool(
        &self,
        flow: &mut Flow,
        wanted: Option<Wanted>,
        streak: u8,
        answer: Answer,
        env: &mut Env,
    ) -> bool {
        let released = flow.released.take().map(|r| r.ticket);
        let key = self.key(flow);
        if !keyspace::key_exists_or_admit(
            self.cfg.max_keys,
            &key,
            keys::COOLDOWN_KEY_COUNT,
            flow.pool,
            env,
        ) {
            return false;
        }
        let now = env.now();
        let jitter = self.cfg.retry_after.jitter;
        let moved = keyspace::modify(env, flow.pool, &key, None, None, |old| {
            let merged = cooldown::merge(old, wanted, streak, now, jitter);
            let next = cooldown::answered(merged, answer, released);
            let moved = old.map_or(0, |o| o.deadline_ms) != next.deadline_ms;
            ((old != Some(next)).then_some(next), moved)
        });
        moved.unwrap_or(false)
    }
}
