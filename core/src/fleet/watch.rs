//! How an Envoy learns a cooldown another Envoy learned, before its own first 429
//! (`fleet.cooldowns`). An Envoy that learns a cooldown from the provider marks its
//! (pool, account) on the service's `COOLING_LIMIT`, and beside it the fleet's marker
//! `ANY_KEY` ("something cools"): a hit on each, again every `MARK_MS` while it cools (the
//! limit's window is a second, so a marker outlives its Envoy by a second at most).
//!
//! Every Envoy checks the fleet's marker every `PEEK_MS`, from load (`CheckRateLimit`, which
//! counts nothing): its workers' timers look at a record in shared data (`Marker`), and the
//! first one due takes the check; the answer goes back to the record for all of them. Only
//! while the fleet's marker says something cools does a worker look closer: its timer checks
//! the marker of each (pool, account) it sent to in the last `WATCH_MS` that nothing cools or
//! paces here, and the first request of a (pool, account) it has not checked lately checks that
//! marker on its way. A (pool, account) marker found makes this Envoy hold its requests and ask
//! for its turn, as after a 429 of its own. So while nothing cools no request pays a call, and
//! an idle Envoy's cost is one check per `PEEK_MS`.

use super::key::TurnKey;
pub use crate::cooldowns::Here;
use crate::keys::MARKER_KEY;
use crate::store::{self, Reader, Record, SharedStore, Writer};

/// How often a worker checks the fleet's marker, and a watched (pool, account) while something
/// cools.
pub const PEEK_MS: u64 = 100;
/// How often an Envoy that cools a (pool, account) marks it (the marker's window is 1 s).
pub const MARK_MS: u64 = 250;
/// How long a (pool, account) is watched after this worker last sent to it.
pub const WATCH_MS: u64 = 60_000;
/// A (pool, account) checked longer ago than this is not known: its next request checks on
/// its way while something cools.
pub const STALE_MS: u64 = 3 * PEEK_MS;
/// How long the fleet's marker counts as cooling after a check found it: its window can lapse
/// for up to `MARK_MS` before the cooling Envoy's next hit, and checks are `PEEK_MS` apart.
/// A check that fails changes nothing; none answered for this long: nothing is known to cool.
pub const LINGER_MS: u64 = MARK_MS + 2 * PEEK_MS;
/// The (pool, account)s one worker watches at most (the least recently sent to goes).
pub const MAX_WATCHED: usize = 32;
/// The fleet's marker's key on `COOLING_LIMIT`: hit beside each (pool, account)'s, whose keys
/// all start with a pool name (`[a-z0-9_-]`), so none is this.
pub const ANY_KEY: &str = "*";

/// A call the watch owes the service now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Look {
    /// Check the fleet's marker: does anything cool?
    PeekAny,
    /// Check the marker of a (pool, account) nothing cools here, while something cools.
    Peek(TurnKey),
    /// Mark a cooling one (and the fleet's marker).
    Mark(TurnKey),
}

#[derive(Clone, Copy, Debug)]
struct Watched {
    key: TurnKey,
    sent_ms: u64,
    /// When the timer last looked at it.
    looked_ms: u64,
    /// When this worker last checked its marker (the timer sent a check, a request's check
    /// was answered).
    known_ms: u64,
    marked_ms: u64,
}

/// What a worker last saw of the fleet's marker.
#[derive(Clone, Copy, Debug, Default)]
struct Any {
    /// When its timer last looked at the record (`Marker`).
    looked_ms: u64,
    /// Whether the record then said something cools (or this worker's check then found it).
    cooled: bool,
}

impl Any {
    /// What the record says now: whether something cools where nothing did (then every
    /// (pool, account) watched is looked at at once).
    fn saw(&mut self, cools: bool) -> bool {
        let newly = cools && !self.cooled;
        self.cooled = cools;
        newly
    }
}

/// The Envoy's record of the fleet's marker in shared data (`keys::MARKER_KEY`), one for its workers:
/// when one of them last took the check, and when a check last found the marker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Marker {
    pub looked_ms: u64,
    pub found_ms: u64,
}

impl Marker {
    const LEN: usize = 16;

    fn read(store: &dyn SharedStore) -> Marker {
        let got = store.get(MARKER_KEY).ok().flatten();
        got.and_then(|(b, _)| Marker::from_bytes(&b))
            .unwrap_or_default()
    }

    /// Whether a check found the marker within `LINGER_MS` of `now`.
    fn cools(&self, now: u64) -> bool {
        self.found_ms != 0 && self.found_ms.saturating_add(LINGER_MS) > now
    }
}

impl Record for Marker {
    fn to_bytes(&self) -> Vec<u8> {
        let w = Writer::<{ Marker::LEN }>::default();
        w.u64(self.looked_ms).u64(self.found_ms).done().to_vec()
    }

    fn from_bytes(bytes: &[u8]) -> Option<Marker> {
        let mut r = Reader::exact(bytes, Marker::LEN)?;
        Some(Marker {
            looked_ms: r.u64()?,
            found_ms: r.u64()?,
        })
    }
}

/// What one worker watches: the fleet's marker, and a few (pool, account)s at a time, a list.
#[derive(Default, Debug)]
pub struct Watch {
    /// None without `fleet.cooldowns`.
    any: Option<Any>,
    keys: Vec<Watched>,
}

impl Watch {
    /// A worker's watch; with `cooldowns` it checks the fleet's marker from load on.
    pub fn new(cooldowns: bool) -> Watch {
        Watch {
            any: cooldowns.then(Any::default),
            keys: Vec::new(),
        }
    }

    /// Nothing to check or mark, now or later.
    pub fn is_empty(&self) -> bool {
        self.any.is_none() && self.keys.is_empty()
    }

    /// Whether the Envoy's last checks of the fleet's marker found it (within `LINGER_MS`).
    pub fn cools(&self, now: u64, store: &dyn SharedStore) -> bool {
        self.any.is_some() && Marker::read(store).cools(now)
    }

    /// A request of `key` goes at `now`: `key` is watched for `WATCH_MS` more. Returns whether
    /// the request must check the marker on its way: something cools, and no check of `key`
    /// was made within `STALE_MS` (every request of a burst checks until the first answer).
    pub fn sent(&mut self, key: TurnKey, now: u64, store: &dyn SharedStore) -> bool {
        let cools = self.cools(now, store);
        let w = match self.keys.iter().position(|w| w.key == key) {
            Some(i) => &mut self.keys[i],
            None => self.push(key, now),
        };
        w.sent_ms = now;
        cools && w.known_ms.saturating_add(STALE_MS) <= now
    }

    /// A request's calls about `key` were answered at `now()` (a check among them, or it
    /// failed: the timer checks next). The clock is read only for a watched `key`.
    pub fn checked(&mut self, key: TurnKey, now: impl FnOnce() -> u64) {
        if let Some(w) = self.keys.iter_mut().find(|w| w.key == key) {
            w.known_ms = w.known_ms.max(now());
        }
    }

    /// This worker's check of the fleet's marker was answered at `now`: whether it found the
    /// marker (None: the check failed, which changes nothing). The record keeps what it found
    /// for every worker; returns whether something cools now where nothing was known to.
    pub fn answered(&mut self, found: Option<bool>, now: u64, store: &dyn SharedStore) -> bool {
        let Some(a) = self.any.as_mut().filter(|_| found == Some(true)) else {
            return false;
        };
        let found = |m: Option<Marker>| {
            let m = m.unwrap_or_default();
            let found_ms = m.found_ms.max(now);
            (Some(Marker { found_ms, ..m }), ())
        };
        // Not written (the record contended past its attempts, or the host failed): this
        // worker knows, the others learn from the next check.
        let _ = store::modify(store, MARKER_KEY, None, None, found);
        let newly = a.saw(true);
        if newly {
            self.keys.iter_mut().for_each(|w| w.looked_ms = 0);
        }
        newly
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
    pub fn due(
        &mut self,
        now: u64,
        store: &dyn SharedStore,
        mut here: impl FnMut(TurnKey) -> Here,
    ) -> Vec<Look> {
        self.keys
            .retain(|w| w.sent_ms.saturating_add(WATCH_MS) > now || here(w.key) == Here::Cools);
        let mut out = Vec::new();
        let Some(a) = self.any.as_mut() else {
            return out;
        };
        if is_due(a.looked_ms, now) {
            a.looked_ms = now;
            let (peek, marker) = take_check(store, now);
            if peek {
                out.push(Look::PeekAny);
            }
            if a.saw(marker.cools(now)) {
                self.keys.iter_mut().for_each(|w| w.looked_ms = 0);
            }
        }
        let cools = a.cooled;
        for w in &mut self.keys {
            if !is_due(w.looked_ms, now) {
                continue;
            }
            w.looked_ms = now;
            match here(w.key) {
                Here::Cools if w.marked_ms.saturating_add(MARK_MS) <= now => {
                    w.marked_ms = now;
                    out.push(Look::Mark(w.key));
                }
                Here::Quiet if cools => {
                    w.known_ms = now;
                    out.push(Look::Peek(w.key));
                }
                Here::Cools | Here::Paces | Here::Quiet => {}
            }
        }
        out
    }

    /// When `due` next may owe a call: None while nothing is watched.
    pub fn next_check_ms(&self) -> Option<u64> {
        let any = self.any.map(|a| a.looked_ms);
        let keys = self.keys.iter().map(|w| w.looked_ms);
        any.into_iter()
            .chain(keys)
            .map(|ms| ms.saturating_add(PEEK_MS))
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
            looked_ms: 0,
            known_ms: 0,
            marked_ms: 0,
        });
        let last = self.keys.len() - 1;
        &mut self.keys[last]
    }
}

/// Whether this worker takes the check of the fleet's marker due at `now` (no worker of the
/// Envoy took one within `PEEK_MS`), and the record as it was. A record that cannot be written
/// leaves the check to each worker.
fn take_check(store: &dyn SharedStore, now: u64) -> (bool, Marker) {
    let take = |m: Option<Marker>| {
        let m = m.unwrap_or_default();
        let due = is_due(m.looked_ms, now);
        let mine = Marker {
            looked_ms: now,
            ..m
        };
        (due.then_some(mine), (due, m))
    };
    match store::modify(store, MARKER_KEY, None, None, take) {
        Ok(u) => u.value,
        Err(_) => (true, Marker::read(store)),
    }
}

/// Whether a look last made at `looked_ms` is due again at `now`.
fn is_due(looked_ms: u64, now: u64) -> bool {
    looked_ms.saturating_add(PEEK_MS) <= now
}
