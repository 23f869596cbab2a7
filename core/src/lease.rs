//! Worker-local leases of request tokens, for buckets far from empty: one compare-and-swap
//! takes `LEASE` tokens, the request spends one, and the worker's next requests of that key
//! spend the rest without touching shared data (each shared-data read and write crosses into
//! Envoy and its process-wide lock).
//!
//! Exactness at the edge is kept: a lease is taken only when the bucket still holds at least
//! `FLOOR` tokens after it (a lease for each of 64 workers), so near empty every request is one
//! compare-and-swap and the bucket stays exact. Leased tokens were taken from the shared bucket, so the total
//! admitted never exceeds the total the bucket gave. A leased token is spent within `LEASE_MS`
//! of the take; what is left then goes back to the bucket in the key's next compare-and-swap
//! (which that request makes anyway), so a tenant sending a few requests a second does not
//! drain its bucket by leases it cannot use. What a lease changes is only when a token is
//! spent: a burst that follows a refill can exceed the bucket by what the workers hold, at
//! most `LEASE - 1` each per key, and only for a bucket that was `FLOOR` tokens from empty
//! moments before.

/// Tokens one compare-and-swap takes when the bucket is far from empty.
pub const LEASE: u64 = 8;
/// The bucket level (in whole tokens, after the lease) below which no lease is taken.
pub const FLOOR: u64 = 64 * LEASE;
/// How long leased tokens may be spent.
pub const LEASE_MS: u64 = 1000;
/// Leases a worker holds at once: a two-way set-associative table (a key whose two slots
/// hold live leases of other keys replaces the one that expires first, dropping what it had
/// left: fewer admitted, never more). 4,096 of 24 bytes, 96 KiB a worker: room for the hot
/// keys of a thousand tenants.
const SLOTS: usize = 4096;

/// (limit index, key id): the bucket a lease came from.
pub type Key = (usize, u64);

/// One worker's leases (the `Worker` owns them and lends them to each call in its `Env`:
/// nothing else shares them, so no lock).
pub struct Leases {
    table: Vec<Option<Lease>>,
    /// Leased tokens dropped unspent (expired, or their slot taken by another key).
    dropped: u64,
}

#[derive(Clone, Copy)]
struct Lease {
    id: u64,
    until_ms: u64,
    limit: u32,
    left: u32,
}

impl Lease {
    fn is(&self, (limit, id): Key) -> bool {
        self.id == id && self.limit as usize == limit
    }
}

impl Default for Leases {
    fn default() -> Self {
        Leases {
            table: vec![None; SLOTS],
            dropped: 0,
        }
    }
}

/// The first of the two slots `key` may use.
fn set_of((limit, id): Key) -> usize {
    ((id ^ (limit as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)) as usize % SLOTS) & !1
}

impl Leases {
    /// Spend one leased token of `key`, if a live lease has one (`Ok`); else `Err(n)`: the `n`
    /// tokens an expired lease left, taken out of it, for the caller to give back to the
    /// shared bucket in its compare-and-swap.
    pub fn spend(&mut self, key: Key, now_ms: u64) -> Result<(), u64> {
        self.with(key, |l| match l {
            Some(l) if l.left > 0 && now_ms < l.until_ms => {
                l.left -= 1;
                Ok(())
            }
            Some(l) => Err(u64::from(std::mem::take(&mut l.left))),
            None => Err(0),
        })
    }

    /// Give back one token spent from `key`'s lease (a later limit refused the request).
    pub fn give(&mut self, key: Key) {
        self.with(key, |l| {
            if let Some(l) = l {
                l.left = l.left.saturating_add(1);
            }
        });
    }

    /// Keep `tokens` taken from the shared bucket of `key` to spend until `now_ms + LEASE_MS`.
    pub fn put(&mut self, key: Key, tokens: u64, now_ms: u64) {
        let table = &mut self.table;
        let set = set_of(key);
        let spent = |l: &Option<Lease>| l.map_or(true, |l| l.left == 0 || now_ms >= l.until_ms);
        let i = (set..set + 2)
            .find(|&i| table[i].is_some_and(|l| l.is(key)))
            .or_else(|| (set..set + 2).find(|&i| spent(&table[i])))
            .unwrap_or_else(|| {
                let until = |i: usize| table[i].map_or(0, |l| l.until_ms);
                if until(set) <= until(set + 1) {
                    set
                } else {
                    set + 1
                }
            });
        let until_ms = now_ms.saturating_add(LEASE_MS);
        let tokens = u32::try_from(tokens).unwrap_or(u32::MAX);
        table[i] = match table[i] {
            // A worker leases only once its lease is spent or expired, so a live lease of the
            // same key is found only if a caller puts twice: its tokens are kept, not dropped.
            Some(l) if l.is(key) && l.left > 0 && now_ms < l.until_ms => Some(Lease {
                left: l.left.saturating_add(tokens),
                until_ms,
                ..l
            }),
            old => {
                let lost = old.map_or(0, |l| u64::from(l.left));
                self.dropped += lost;
                Some(Lease {
                    id: key.1,
                    limit: u32::try_from(key.0).unwrap_or(u32::MAX),
                    left: tokens,
                    until_ms,
                })
            }
        };
    }

    /// Tokens taken from shared buckets that this worker has not spent: those its leases still
    /// hold (live or expired) and those it dropped. With what it admitted, exactly what the
    /// buckets gave it.
    pub fn unspent(&self) -> u64 {
        let held: u64 = self.table.iter().flatten().map(|l| u64::from(l.left)).sum();
        held + self.dropped
    }

    /// Leased tokens of `key` that could still be spent at `now_ms`.
    pub fn left(&self, key: Key, now_ms: u64) -> u64 {
        let set = set_of(key);
        match self.table[set..set + 2]
            .iter()
            .flatten()
            .find(|l| l.is(key))
        {
            Some(l) if now_ms < l.until_ms => u64::from(l.left),
            _ => 0,
        }
    }

    /// Run `f` on the lease of `key` (None when its slot is empty or another key's).
    fn with<T>(&mut self, key: Key, f: impl FnOnce(Option<&mut Lease>) -> T) -> T {
        let set = set_of(key);
        f(self.table[set..set + 2]
            .iter_mut()
            .flatten()
            .find(|l| l.is(key)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_spent_until_empty_or_expired() {
        let mut l = Leases::default();
        let k = (0, 42);
        assert_eq!(l.spend(k, 0), Err(0));
        l.put(k, 2, 100);
        assert_eq!(l.spend(k, 100), Ok(()));
        l.give(k);
        assert_eq!(l.spend(k, 200), Ok(()));
        assert_eq!(l.spend(k, 300), Ok(()));
        assert_eq!(l.spend(k, 300), Err(0));
        assert_eq!(l.spend((1, 42), 300), Err(0), "another limit's bucket");
        l.put(k, 5, 1000);
        l.spend(k, 1000).unwrap();
        // Expired: the 4 left come out, once, to go back to the bucket.
        assert_eq!(l.spend(k, 1000 + LEASE_MS), Err(4));
        assert_eq!(l.spend(k, 1000 + LEASE_MS), Err(0));
    }

    #[test]
    fn a_key_in_a_taken_slot_replaces_it_and_never_spends_the_others_tokens() {
        let mut l = Leases::default();
        let a = (0, 7);
        let b = (0, 7 + SLOTS as u64); // the same two slots
        let c = (0, 7 + 2 * SLOTS as u64);
        l.put(a, 3, 0);
        assert_eq!(l.left(b, 0), 0);
        assert_eq!(l.spend(b, 0), Err(0));
        l.put(b, 2, 1);
        assert_eq!((l.left(a, 1), l.left(b, 1)), (3, 2), "two ways: both kept");
        l.put(c, 1, 2);
        assert_eq!(
            l.left(a, 2),
            0,
            "a's lease expires first: dropped, not shared"
        );
        assert_eq!((l.left(b, 2), l.left(c, 2)), (2, 1));
        assert_eq!(l.unspent(), 3 + 3, "held 2 + 1, dropped 3");
    }
}
