//! Why a request cannot go now, as a value every wait reads: the hold (whether and how long to
//! wait), failover (whether another pool may serve it) and the local answer (what to tell).

use crate::classify::Class;

/// Why a request cannot go now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocked {
    /// The provider is cooling this (pool, account).
    Cooling { class: Class, remaining_ms: u64 },
    /// The cooldown ended and the pace has no release open.
    Paced { retry_in_ms: u64 },
    /// Another worker of the fleet holds this (pool, account)'s turn (`fleet::turn`): only it
    /// sends what the cooldown's pace lets go. Asked again after `retry_in_ms`.
    Turn { retry_in_ms: u64 },
    /// A local request bucket (or token budget) is empty.
    Bucket {
        limit: usize,
        wait_ms: u64,
        remaining: u64,
    },
    /// The fleet's rate-limit service refused a `scope: fleet` limit; its wait is the
    /// service's reset. Only the service knows when it has room again: a held request asks it.
    Fleet { limit: usize, wait_ms: u64 },
    /// A `max_in_flight` cap is full.
    InFlight { limit: usize },
    /// The fleet's service has no slot of a `scope: fleet` `max_in_flight` free: a slot frees
    /// when some stream of the fleet ends, which only the service sees. Asked again after
    /// `retry_in_ms`.
    Slot { limit: usize, retry_in_ms: u64 },
    /// The provider reported this account's quota exhausted: waiting cannot help.
    Quota { remaining_ms: u64 },
    /// The request's reservation is larger than the token budget can ever hold.
    TooLarge { limit: usize, tokens: u64 },
}

impl Blocked {
    /// How long the wait is known to last; None when it ends with an event (an answer, a
    /// stream's end) rather than at a time.
    pub fn wait_ms(&self) -> Option<u64> {
        match *self {
            Blocked::Cooling { remaining_ms, .. } => Some(remaining_ms),
            Blocked::Bucket { wait_ms, .. } | Blocked::Fleet { wait_ms, .. } => Some(wait_ms),
            Blocked::Paced { .. }
            | Blocked::Turn { .. }
            | Blocked::InFlight { .. }
            | Blocked::Slot { .. }
            | Blocked::Quota { .. }
            | Blocked::TooLarge { .. } => None,
        }
    }

    /// Whether holding can help: everything but quota exhaustion and a request too large.
    pub fn holdable(&self) -> bool {
        !matches!(self, Blocked::Quota { .. } | Blocked::TooLarge { .. })
    }

    /// Whether a fallback pool can serve the request instead: the provider side is saying
    /// "not now" (cooling, pacing, quota) or the pool's concurrency cap is full. An empty
    /// bucket (local or the fleet's) is the operator's own limit for the tenant and is never
    /// steered around.
    pub fn steerable(&self) -> bool {
        !matches!(
            self,
            Blocked::Bucket { .. } | Blocked::Fleet { .. } | Blocked::TooLarge { .. }
        )
    }

    /// The limit that refused, for a bucket (local or the fleet's) or a cap.
    pub fn limit(&self) -> Option<usize> {
        match *self {
            Blocked::Bucket { limit, .. }
            | Blocked::Fleet { limit, .. }
            | Blocked::InFlight { limit }
            | Blocked::Slot { limit, .. }
            | Blocked::TooLarge { limit, .. } => Some(limit),
            _ => None,
        }
    }

    /// When to ask again, at the latest. Waits that end with an event (an answer, a stream's
    /// end, on any worker) are asked again on every tick; the fleet's turn and its slots, after
    /// a pause (each ask is a call to the service).
    pub fn recheck_in_ms(&self) -> u64 {
        match *self {
            Blocked::Turn { retry_in_ms } | Blocked::Slot { retry_in_ms, .. } => retry_in_ms,
            _ => self.wait_ms().unwrap_or(0),
        }
    }

    /// As it stands `elapsed` ms later: known waits shrink (to at least 1 ms).
    pub fn aged(self, elapsed: u64) -> Blocked {
        self.with_times(|ms| ms.saturating_sub(elapsed).max(1))
    }

    /// As it stands for a request `ms` behind the one it would let go: a known wait (or the
    /// pace's next try) that much longer. A full cap says no time.
    pub fn later(self, ms: u64) -> Blocked {
        self.with_times(|t| t.saturating_add(ms))
    }

    /// The same wait with each time it states (a wait, the pace's next try) `f` of what it was.
    fn with_times(self, f: impl Fn(u64) -> u64) -> Blocked {
        match self {
            Blocked::Cooling {
                class,
                remaining_ms,
            } => Blocked::Cooling {
                class,
                remaining_ms: f(remaining_ms),
            },
            Blocked::Bucket {
                limit,
                wait_ms,
                remaining,
            } => Blocked::Bucket {
                limit,
                wait_ms: f(wait_ms),
                remaining,
            },
            Blocked::Fleet { limit, wait_ms } => Blocked::Fleet {
                limit,
                wait_ms: f(wait_ms),
            },
            Blocked::Paced { retry_in_ms } => Blocked::Paced {
                retry_in_ms: f(retry_in_ms),
            },
            Blocked::Turn { retry_in_ms } => Blocked::Turn {
                retry_in_ms: f(retry_in_ms),
            },
            Blocked::Slot { limit, retry_in_ms } => Blocked::Slot {
                limit,
                retry_in_ms: f(retry_in_ms),
            },
            Blocked::Quota { remaining_ms } => Blocked::Quota {
                remaining_ms: f(remaining_ms),
            },
            other => other,
        }
    }

    /// Whether waiting for `self` ends sooner than waiting for `other`: a known wait beats an
    /// unknown one (an unknown wait ends with an event that may never come soon), shorter
    /// beats longer, and a wait that cannot end beats nothing.
    pub fn frees_sooner_than(&self, other: &Blocked) -> bool {
        match (self.holdable(), other.holdable()) {
            (true, false) => return true,
            (false, _) => return false,
            _ => {}
        }
        match (self.wait_ms(), other.wait_ms()) {
            (Some(x), Some(y)) => x < y,
            (Some(_), None) => true,
            _ => false,
        }
    }
}
