//! How an Envoy learns a cooldown another Envoy learned, before its own first 429
//! (`fleet.cooldowns`). An Envoy that learns a cooldown from the provider marks its
//! (pool, account) on the service's `COOLING_LIMIT` (a hit, again every `MARK_MS` while it
//! cools; the limit's window is a second, so a marker outlives its Envoy by a second at most).
//! Every worker watches the (pool, account)s it sent to in the last `WATCH_MS`: while nothing
//! cools or paces one of them here, it checks the marker every `PEEK_MS` from its timer
//! (`CheckRateLimit`, which counts nothing); a marker found makes this Envoy hold that
//! (pool, account)'s requests and ask for its turn, as after a 429 of its own. So a request
//! pays no call while nothing cools: only the first request of a (pool, account) after a quiet
//! minute (or after this worker could not look for `STALE_MS`) checks on its way.

use super::key::TurnKey;
pub use crate::cooldowns::Here;

/// How often a worker checks a watched (pool, account) nothing cools here.
pub const PEEK_MS: u64 = 100;
/// How often an Envoy that cools a (pool, account) marks it (the marker's window is 1 s).
pub const MARK_MS: u64 = 250;
/// How long a (pool, account) is watched after this worker last sent to it.
pub const WATCH_MS: u64 = 60_000;
/// A check older than this is stale: the next request checks on its way.
pub const STALE_MS: u64 = 3 * PEEK_MS;
/// The (pool, account)s one worker watches at most (the least recently sent to goes).
pub const MAX_WATCHED: usize = 32;

/// A call the watch owes the service now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Look {
    /// Check the marker of a quiet (pool, account).
    Peek(TurnKey),
    /// Mark a cooling one.
    Mark(TurnKey),
}

#[derive(Clone, Copy, Debug)]
struct Watched {
    key: TurnKey,
    sent_ms: u64,
    checked_ms: u64,
    marked_ms: u64,
}

/// The (pool, account)s one worker watches: a few at a time, a list.
#[derive(Default, Debug)]
pub struct Watch {
    keys: Vec<Watched>,
}

impl Watch {
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// A request of `key` goes at `now`: `key` is watched for `WATCH_MS` more. Returns whether
    /// the request must check the marker on its way: no check of it was answered within
    /// `STALE_MS` (every request of a burst checks until the first answer comes).
    pub fn sent(&mut self, key: TurnKey, now: u64) -> bool {
        if let Some(w) = self.keys.iter_mut().find(|w| w.key == key) {
            w.sent_ms = now;
            return w.checked_ms.saturating_add(STALE_MS) <= now;
        }
        self.push(key, now);
        true
    }

    /// A request's check of `key` was answered at `now` (or failed: the timer checks next).
    pub fn checked(&mut self, key: TurnKey, now: u64) {
        if let Some(w) = self.keys.iter_mut().find(|w| w.key == key) {
            w.checked_ms = w.checked_ms.max(now);
        }
    }

    /// This worker learned a cooldown of `key` from the provider at `now`: whether to mark it
    /// now (it was not marked within `MARK_MS`: every answer of a burst would).
    pub fn learned(&mut self, key: TurnKey, now: u64) -> bool {
        let w = match self.keys.iter().position(|w| w.key == key) {
            Some(i) => &mut self.keys[i],
            None => self.push(key, now),
        };
        let due = w.marked_ms == 0 || w.marked_ms.saturating_add(MARK_MS) <= now;
        if due {
            w.marked_ms = now;
        }
        due
    }

    /// The calls due at `now`; `here(key)` says what this Envoy knows of `key` itself.
    /// (pool, account)s not sent to for `WATCH_MS` are forgotten, unless they cool here (a
    /// cooldown longer than that is marked to its end).
    pub fn due(&mut self, now: u64, mut here: impl FnMut(TurnKey) -> Here) -> Vec<Look> {
        self.keys
            .retain(|w| w.sent_ms.saturating_add(WATCH_MS) > now || here(w.key) == Here::Cools);
        let mut out = Vec::new();
        for w in &mut self.keys {
            if w.checked_ms.saturating_add(PEEK_MS) > now {
                continue;
            }
            w.checked_ms = now;
            match here(w.key) {
                Here::Cools if w.marked_ms.saturating_add(MARK_MS) <= now => {
                    w.marked_ms = now;
                    out.push(Look::Mark(w.key));
                }
                Here::Quiet => out.push(Look::Peek(w.key)),
                Here::Cools | Here::Paces => {}
            }
        }
        out
    }

    /// When `due` next may owe a call: None while nothing is watched.
    pub fn next_check_ms(&self) -> Option<u64> {
        self.keys
            .iter()
            .map(|w| w.checked_ms.saturating_add(PEEK_MS))
            .min()
    }

    fn push(&mut self, key: TurnKey, now: u64) -> &mut Watched {
        if self.keys.len() >= MAX_WATCHED {
            if let Some(oldest) = (0..self.keys.len()).min_by_key(|&i| self.keys[i].sent_ms) {
                self.keys.swap_remove(oldest);
            }
        }
        self.keys.push(Watched {
            key,
            sent_ms: now,
            checked_ms: 0,
            marked_ms: 0,
        });
        let last = self.keys.len() - 1;
        &mut self.keys[last]
    }
}
