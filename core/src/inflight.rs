//! `max_in_flight` slots, counted across workers in one shared-data record per key.
//!
//! A slot is taken when a request is forwarded and given back when its stream ends, however it
//! ends. A VM that is replaced (a crash under `FAIL_RELOAD`) never gives its slots back, so
//! slots are counted in epochs: the record keeps the counts of the last `EPOCHS` epochs of
//! `lease_ms / (EPOCHS - 1)` each, and a slot taken in an epoch that has left the ring is no
//! longer counted. A slot is therefore counted while its stream lasts, for at least `lease_ms`
//! and at most `lease_ms` plus one epoch; a stream that outlives that is no longer counted (its
//! end then gives nothing back), which is why the lease should exceed the longest stream.

pub const EPOCHS: usize = 4;
use crate::store::{Reader, Writer};

pub const ENCODED_LEN: usize = 8 + 4 * EPOCHS;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Slots {
    /// The newest epoch the counts are relative to: `counts[i]` belongs to epoch `newest - i`.
    pub newest: u64,
    pub counts: [u32; EPOCHS],
}

/// Where a taken slot is counted, to give it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub epoch: u64,
}

pub fn epoch_of(now_ms: u64, lease_ms: u64) -> u64 {
    now_ms / (lease_ms / (EPOCHS as u64 - 1)).max(1)
}

impl Slots {
    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        let w = Writer::default().u64(self.newest);
        self.counts.iter().fold(w, |w, c| w.u32(*c)).done()
    }

    /// None for bytes this code did not write (a wrong length).
    pub fn decode(b: &[u8]) -> Option<Slots> {
        let mut r = Reader::exact(b, ENCODED_LEN)?;
        let newest = r.u64()?;
        let mut counts = [0u32; EPOCHS];
        for c in &mut counts {
            *c = r.u32()?;
        }
        Some(Slots { newest, counts })
    }

    /// The counts as of `epoch`: epochs that left the ring are dropped (their slots reclaimed).
    /// A clock that went backwards keeps the ring as it is.
    pub fn at(self, epoch: u64) -> Slots {
        if epoch <= self.newest {
            return self;
        }
        let shift = epoch - self.newest;
        let mut counts = [0u32; EPOCHS];
        for (i, c) in self.counts.iter().enumerate() {
            if let Some(j) = usize::try_from(shift).ok().and_then(|s| s.checked_add(i)) {
                if j < EPOCHS {
                    counts[j] = *c;
                }
            }
        }
        Slots {
            newest: epoch,
            counts,
        }
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().map(|c| u64::from(*c)).sum()
    }

    /// Take a slot if fewer than `cap` are taken.
    pub fn acquire(self, epoch: u64, cap: u64) -> Option<(Slots, Slot)> {
        let mut s = self.at(epoch);
        if s.total() >= cap {
            return None;
        }
        s.counts[0] = s.counts[0].saturating_add(1);
        Some((s, Slot { epoch: s.newest }))
    }

    /// Give back a slot taken in `slot.epoch`; nothing when that epoch has left the ring.
    pub fn release(self, slot: Slot, epoch: u64) -> Slots {
        let mut s = self.at(epoch);
        if let Some(i) = s
            .newest
            .checked_sub(slot.epoch)
            .and_then(|d| usize::try_from(d).ok())
        {
            if let Some(c) = s.counts.get_mut(i) {
                *c = c.saturating_sub(1);
            }
        }
        s
    }
}

impl crate::store::Record for Slots {
    fn to_bytes(&self) -> Vec<u8> {
        self.encode().to_vec()
    }

    fn from_bytes(bytes: &[u8]) -> Option<Slots> {
        Slots::decode(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: u64 = 3000; // epochs of 1 s

    #[test]
    fn cap_is_exact_and_release_frees() {
        let e = epoch_of(10_000, LEASE);
        let mut s = Slots::default();
        let mut taken = Vec::new();
        for _ in 0..3 {
            let (n, slot) = s.acquire(e, 3).expect("room");
            s = n;
            taken.push(slot);
        }
        assert_eq!(s.acquire(e, 3), None);
        s = s.release(taken[0], e);
        assert_eq!(s.total(), 2);
        assert!(s.acquire(e, 3).is_some());
    }

    #[test]
    fn a_vanished_slot_is_reclaimed_after_the_lease() {
        let mut s = Slots::default();
        let (n, _lost) = s.acquire(epoch_of(0, LEASE), 1).expect("room");
        s = n;
        // Counted for at least the lease...
        assert_eq!(s.acquire(epoch_of(2_999, LEASE), 1), None);
        // ...and at most the lease plus one epoch.
        assert!(s.acquire(epoch_of(4_000, LEASE), 1).is_some());
    }

    #[test]
    fn releasing_a_reclaimed_slot_gives_nothing_back() {
        let (s, old) = Slots::default().acquire(0, 2).expect("room");
        let (s, _) = s.acquire(9, 2).expect("room: the first left the ring");
        let s = s.release(old, 9);
        assert_eq!(s.total(), 1);
    }

    #[test]
    fn encoding_round_trips() {
        let s = Slots {
            newest: 77,
            counts: [1, 2, 3, u32::MAX],
        };
        assert_eq!(Slots::decode(&s.encode()), Some(s));
        assert_eq!(Slots::decode(&[0; 5]), None);
    }
}
