//! Token-per-minute buckets, the way OpenAI documents its TPM limit: a bucket of `capacity`
//! tokens that refills continuously at `capacity` per minute, each request taking its count
//! (estimated input + output limit) at admission, a request that does not fit taking nothing.
//!
//! Exact integer arithmetic: a level is kept in units of 1 / 60,000,000,000 token, so one
//! nanosecond refills exactly `capacity` units and no rounding drifts over a long run.

use std::time::Instant;

/// Units per token: the nanoseconds in the refill period (one minute).
const UNITS_PER_TOKEN: u128 = 60_000_000_000;
/// The largest `tpm.tokens` a scenario may set (keeps every product below u128::MAX).
pub const MAX_CAPACITY: u64 = 1_000_000_000;

/// One key's bucket: its level at `at`, refilled lazily from `at` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    level: u128,
    at: Instant,
}

/// What a request's count meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    Fits,
    /// It would fit in `wait_ms`.
    Wait {
        wait_ms: u64,
    },
    /// It never fits: the count is over the capacity.
    TooLarge,
}

/// The bucket as an answer reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Level {
    /// Tokens in use: capacity minus the whole tokens left.
    pub used: u64,
    /// Whole tokens left.
    pub remaining: u64,
    /// Until the bucket is full again, in ms (rounded up).
    pub reset_ms: u64,
}

fn ceil_ms_of_ns(ns: u128) -> u64 {
    ns.div_ceil(1_000_000).min(u64::MAX as u128) as u64
}

fn units(capacity: u64) -> u128 {
    capacity.clamp(1, MAX_CAPACITY) as u128 * UNITS_PER_TOKEN
}

impl Bucket {
    pub fn full(capacity: u64, now: Instant) -> Bucket {
        Bucket {
            level: units(capacity),
            at: now,
        }
    }

    /// The level at `now` (a `now` before `at` reads as `at`).
    fn level_at(&self, capacity: u64, now: Instant) -> u128 {
        let rate = capacity.clamp(1, MAX_CAPACITY) as u128;
        let elapsed = now.saturating_duration_since(self.at).as_nanos();
        self.level
            .saturating_add(elapsed.saturating_mul(rate))
            .min(units(capacity))
    }

    /// Whether `count` tokens fit at `now`, and if not when they would. Changes nothing.
    pub fn check(&self, capacity: u64, now: Instant, count: u64) -> Take {
        let capacity = capacity.clamp(1, MAX_CAPACITY);
        let level = self.level_at(capacity, now);
        let need = (count as u128).saturating_mul(UNITS_PER_TOKEN);
        if count > capacity {
            Take::TooLarge
        } else if need <= level {
            Take::Fits
        } else {
            Take::Wait {
                wait_ms: ceil_ms_of_ns((need - level).div_ceil(capacity as u128)).max(1),
            }
        }
    }

    /// Takes `count` tokens at `now` if they fit (see `check`); otherwise takes nothing.
    pub fn charge(&mut self, capacity: u64, now: Instant, count: u64) -> Take {
        let take = self.check(capacity, now, count);
        let level = self.level_at(capacity, now);
        self.level = match take {
            Take::Fits => level - count as u128 * UNITS_PER_TOKEN,
            _ => level,
        };
        // Kept monotonic, so an older `now` never refills twice.
        self.at = self.at.max(now);
        take
    }

    pub fn level(&self, capacity: u64, now: Instant) -> Level {
        let capacity = capacity.clamp(1, MAX_CAPACITY);
        let level = self.level_at(capacity, now);
        let whole = (level / UNITS_PER_TOKEN).min(u64::MAX as u128) as u64;
        Level {
            used: capacity - whole,
            remaining: whole,
            reset_ms: ceil_ms_of_ns((units(capacity) - level).div_ceil(capacity as u128)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const CAP: u64 = 20_000;

    fn ms(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    /// Charges and reads the level after, as the simulator does for a served request.
    fn step(b: &mut Bucket, now: Instant, count: u64) -> (Take, u64, u64, u64) {
        let used_before = b.level(CAP, now).used;
        let take = b.charge(CAP, now, count);
        let l = b.level(CAP, now);
        (take, used_before, l.remaining, l.reset_ms)
    }

    #[test]
    fn fits_then_does_not_then_refills() {
        let t0 = Instant::now();
        let mut b = Bucket::full(CAP, t0);
        // One row per step: (at ms, count, take, used before, remaining after, reset ms).
        let rows: [(u64, u64, Take, u64, u64, u64); 6] = [
            // 19,000 fit; reset = 19,000 tokens at 1/3 token per ms = 57 s.
            (0, 19_000, Take::Fits, 0, 1_000, 57_000),
            // 1,500 does not fit 1,000: 500 more tokens take 1.5 s. Nothing is charged.
            (
                0,
                1_500,
                Take::Wait { wait_ms: 1_500 },
                19_000,
                1_000,
                57_000,
            ),
            // 300 ms later 100 tokens have come back: the wait is 1.2 s.
            (
                300,
                1_500,
                Take::Wait { wait_ms: 1_200 },
                18_900,
                1_100,
                56_700,
            ),
            // At 1.5 s it fits exactly, and the bucket is empty.
            (1_500, 1_500, Take::Fits, 18_500, 0, 60_000),
            // Over the capacity: never fits, charged nothing.
            (1_500, CAP + 1, Take::TooLarge, 20_000, 0, 60_000),
            // A whole minute later the bucket is full, not more.
            (90_000, CAP, Take::Fits, 0, 0, 60_000),
        ];
        for (i, (at, count, take, used, remaining, reset)) in rows.into_iter().enumerate() {
            assert_eq!(
                step(&mut b, ms(t0, at), count),
                (take, used, remaining, reset),
                "row {i}"
            );
        }
    }

    #[test]
    fn check_changes_nothing() {
        let t0 = Instant::now();
        let mut b = Bucket::full(CAP, t0);
        b.charge(CAP, t0, 15_000);
        let before = b;
        assert_eq!(b.check(CAP, ms(t0, 10), 4_000), Take::Fits);
        assert_eq!(
            b.check(CAP, ms(t0, 10), 6_000),
            Take::Wait { wait_ms: 2_990 }
        );
        assert_eq!(b, before);
    }

    #[test]
    fn waits_round_up_and_are_never_zero() {
        let t0 = Instant::now();
        let mut b = Bucket::full(CAP, t0);
        b.charge(CAP, t0, CAP);
        // One token takes 3 ms exactly; a third of a token is still 1 ms away, not 0.
        assert_eq!(b.check(CAP, t0, 1), Take::Wait { wait_ms: 3 });
        let just_short = t0 + Duration::from_micros(2_999);
        assert_eq!(b.check(CAP, just_short, 1), Take::Wait { wait_ms: 1 });
        assert_eq!(b.check(CAP, ms(t0, 3), 1), Take::Fits);
        // A capacity that does not divide a minute evenly: 7 tokens per minute.
        let mut b = Bucket::full(7, t0);
        b.charge(7, t0, 7);
        assert_eq!(b.check(7, t0, 1), Take::Wait { wait_ms: 8_572 }); // 60,000 / 7 = 8,571.4
        assert_eq!(b.level(7, t0).reset_ms, 60_000);
    }

    #[test]
    fn extremes_do_not_overflow() {
        let t0 = Instant::now();
        let mut b = Bucket::full(MAX_CAPACITY, t0);
        assert_eq!(b.charge(MAX_CAPACITY, t0, u64::MAX), Take::TooLarge);
        assert_eq!(b.level(MAX_CAPACITY, t0).remaining, MAX_CAPACITY);
        // Years later, still capped at the capacity.
        let later = t0 + Duration::from_secs(10 * 365 * 86_400);
        assert_eq!(b.charge(MAX_CAPACITY, later, MAX_CAPACITY), Take::Fits);
        let l = b.level(MAX_CAPACITY, later);
        assert_eq!((l.remaining, l.reset_ms), (0, 60_000));
        // A `now` older than the last one reads as the last one.
        assert_eq!(b.check(MAX_CAPACITY, t0, 1), Take::Wait { wait_ms: 1 });
        // A capacity out of range (the scenario rejects it) is clamped, not a panic.
        let z = Bucket::full(0, t0);
        assert_eq!(z.check(0, t0, 1), Take::Fits);
        assert_eq!(z.check(0, t0, 2), Take::TooLarge);
    }
}
