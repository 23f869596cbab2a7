//! What a call into the core is lent: the host's shared store and stats, and the worker's own
//! randomness, leases and clock reading.

use crate::lease::Leases;
use crate::metrics::Metrics;
use crate::retry_after::Random;
use crate::store::SharedStore;

/// Trait objects rather than generics: one indirect call per store or metrics operation is
/// nothing next to a hostcall, and the policy reads as plain code.
pub struct Env<'a> {
    pub store: &'a dyn SharedStore,
    pub metrics: &'a mut dyn Metrics,
    pub rng: &'a mut dyn Random,
    /// The worker's leases of request tokens (`lease.rs`).
    pub leases: &'a mut Leases,
    pub clock: Clock<'a>,
}

impl Env<'_> {
    /// The time of this call, in ms since the epoch.
    pub fn now(&self) -> u64 {
        self.clock.now()
    }
}

/// Where `Env::now` comes from: a time already read, or the host's clock, read the first time
/// the core asks and kept for the rest of the call (a plain success never asks, and skips the
/// hostcall).
pub enum Clock<'a> {
    At(u64),
    Lazy(&'a dyn Fn() -> u64, std::cell::OnceCell<u64>),
}

impl<'a> Clock<'a> {
    pub fn lazy(read: &'a dyn Fn() -> u64) -> Clock<'a> {
        Clock::Lazy(read, std::cell::OnceCell::new())
    }

    pub fn now(&self) -> u64 {
        match self {
            Clock::At(ms) => *ms,
            Clock::Lazy(read, once) => *once.get_or_init(read),
        }
    }

    /// The time, if it has been read.
    pub fn known(&self) -> Option<u64> {
        match self {
            Clock::At(ms) => Some(*ms),
            Clock::Lazy(_, once) => once.get().copied(),
        }
    }
}
