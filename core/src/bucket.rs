//! Token buckets with lazy refill, stored as 16 fixed-width bytes in shared data.
//!
//! Amounts are kept in units of 1 / 86,400,000 token (the milliseconds of a day): a bucket
//! refilling `n` tokens a minute then gains exactly `1440 n` units every millisecond, and one
//! refilling `n` a day exactly `n`, so refill is integer arithmetic with no rounding, however
//! often it is evaluated. The level may go below zero: usage is charged after the response,
//! and a debt must be repaid by refill.

/// Units per token: every window a rate field has (a minute, a day) divides it in ms.
const UNIT: i64 = 86_400_000;
use crate::config::Limit;
use crate::store::{Reader, Writer};

pub const ENCODED_LEN: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Current level in units (`UNIT` per token); may be negative (debt).
    pub level: i64,
    /// When `level` was last brought up to date, Unix ms.
    pub updated_ms: u64,
}

/// The shape of one bucket: refill rate (`per_window` every `window_ms`) and capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub per_window: u64,
    /// A minute or a day (any divisor of a day's ms refills without rounding).
    pub window_ms: u64,
    pub burst: u64,
}

impl Shape {
    /// `per_minute` tokens a minute, `burst` at most.
    pub fn per_minute(per_minute: u64, burst: u64) -> Shape {
        Shape {
            per_window: per_minute,
            window_ms: 60_000,
            burst,
        }
    }
}

impl From<&Limit> for Shape {
    fn from(limit: &Limit) -> Shape {
        Shape {
            per_window: limit.per_window,
            window_ms: limit.window_ms(),
            burst: limit.burst,
        }
    }
}

/// What a take decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Take {
    pub admitted: bool,
    /// Whole tokens left after this take (0 when empty or in debt).
    pub remaining: u64,
    /// Milliseconds until `amount` tokens are available again (0 when admitted).
    pub wait_ms: u64,
}

impl Bucket {
    pub fn full(shape: Shape, now_ms: u64) -> Bucket {
        Bucket {
            level: to_units(shape.burst),
            updated_ms: now_ms,
        }
    }

    /// The level in whole tokens, rounded down: part of a token of debt reads as -1.
    pub fn tokens(&self) -> i64 {
        self.level.div_euclid(UNIT)
    }

    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        Writer::default()
            .i64(self.level)
            .u64(self.updated_ms)
            .done()
    }

    /// None for bytes of the wrong length: a value this code did not write is not trusted.
    pub fn decode(bytes: &[u8]) -> Option<Bucket> {
        let mut r = Reader::exact(bytes, ENCODED_LEN)?;
        Some(Bucket {
            level: r.i64()?,
            updated_ms: r.u64()?,
        })
    }

    /// Bring the level up to `now_ms`. A clock that went backwards refills nothing.
    pub fn refill(self, shape: Shape, now_ms: u64) -> Bucket {
        let elapsed = now_ms.saturating_sub(self.updated_ms);
        let gained = i128::from(elapsed) * i128::from(units_per_ms(shape));
        let level = (i128::from(self.level) + gained).min(i128::from(to_units(shape.burst)));
        Bucket {
            level: i64::try_from(level).unwrap_or(i64::MAX),
            updated_ms: now_ms.max(self.updated_ms),
        }
    }

    /// Take `amount` tokens if the bucket has them.
    pub fn take(self, shape: Shape, now_ms: u64, amount: u64) -> (Bucket, Take) {
        let b = self.refill(shape, now_ms);
        let want = to_units(amount);
        if b.level >= want {
            let after = Bucket {
                level: b.level - want,
                ..b
            };
            let remaining = u64::try_from(after.level / UNIT).unwrap_or(0);
            (
                after,
                Take {
                    admitted: true,
                    remaining,
                    wait_ms: 0,
                },
            )
        } else {
            let wait_ms = wait_for(shape, want.min(to_units(shape.burst)) - b.level);
            let remaining = u64::try_from(b.level.max(0) / UNIT).unwrap_or(0);
            (
                b,
                Take {
                    admitted: false,
                    remaining,
                    wait_ms,
                },
            )
        }
    }

    /// Whether `amount` tokens are there, without taking them (token budgets are charged after
    /// the response, from the usage the provider reports).
    pub fn check(self, shape: Shape, now_ms: u64, amount: u64) -> Take {
        self.take(shape, now_ms, amount).1
    }

    /// Give back `amount` tokens taken for a request that did not go (never above the burst).
    pub fn give(self, shape: Shape, now_ms: u64, amount: u64) -> Bucket {
        let b = self.refill(shape, now_ms);
        Bucket {
            level: b
                .level
                .saturating_add(to_units(amount))
                .min(to_units(shape.burst)),
            ..b
        }
    }

    /// Charge `amount` tokens unconditionally (may go into debt, bounded at one burst).
    pub fn charge(self, shape: Shape, now_ms: u64, amount: u64) -> Bucket {
        let b = self.refill(shape, now_ms);
        let floor = -to_units(shape.burst);
        Bucket {
            level: b.level.saturating_sub(to_units(amount)).max(floor),
            ..b
        }
    }
}

fn to_units(tokens: u64) -> i64 {
    i64::try_from(tokens)
        .unwrap_or(i64::MAX / UNIT)
        .saturating_mul(UNIT)
}

fn units_per_ms(shape: Shape) -> i64 {
    let per_ms =
        i128::from(shape.per_window) * i128::from(UNIT) / i128::from(shape.window_ms.max(1));
    i64::try_from(per_ms).unwrap_or(i64::MAX)
}

/// Milliseconds until `deficit` units have refilled, rounded up.
fn wait_for(shape: Shape, deficit: i64) -> u64 {
    let rate = units_per_ms(shape);
    if deficit <= 0 || rate <= 0 {
        return 0;
    }
    u64::try_from(deficit.saturating_add(rate - 1) / rate).unwrap_or(u64::MAX)
}

impl crate::store::Record for Bucket {
    fn to_bytes(&self) -> Vec<u8> {
        self.encode().to_vec()
    }

    fn from_bytes(bytes: &[u8]) -> Option<Bucket> {
        Bucket::decode(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Shape = Shape {
        per_window: 60,
        window_ms: 60_000,
        burst: 5,
    };

    #[test]
    fn burst_then_refill_one_per_second() {
        let mut b = Bucket::full(SHAPE, 1000);
        for i in 0..5 {
            let (nb, t) = b.take(SHAPE, 1000, 1);
            assert!(t.admitted, "take {i}");
            assert_eq!(t.remaining, 4 - i);
            b = nb;
        }
        let (b, t) = b.take(SHAPE, 1000, 1);
        assert!(!t.admitted);
        assert_eq!(t.wait_ms, 1000);
        let (_, t) = b.take(SHAPE, 1999, 1);
        assert!(!t.admitted);
        assert_eq!(t.wait_ms, 1);
        let (_, t) = b.take(SHAPE, 2000, 1);
        assert!(t.admitted);
    }

    #[test]
    fn slow_rates_do_not_lose_fractions() {
        let shape = Shape::per_minute(1, 1);
        let mut b = Bucket::full(shape, 0);
        b = b.take(shape, 0, 1).0;
        // Evaluate every millisecond for a minute: must be exactly refilled at 60 s.
        for t in 1..60_000 {
            b = b.refill(shape, t);
        }
        assert!(!b.take(shape, 59_999, 1).1.admitted);
        assert!(b.take(shape, 60_000, 1).1.admitted);
    }

    #[test]
    fn a_day_window_refills_evenly_over_the_day() {
        // 864 a day: one every 100 s, exactly, however often the bucket is looked at.
        let shape = Shape {
            per_window: 864,
            window_ms: 86_400_000,
            burst: 864,
        };
        let mut b = Bucket::full(shape, 0).take(shape, 0, 864).0;
        for t in (1..100_000).step_by(7) {
            b = b.refill(shape, t);
        }
        let (_, t) = b.take(shape, 99_999, 1);
        assert_eq!((t.admitted, t.wait_ms), (false, 1));
        assert!(b.take(shape, 100_000, 1).1.admitted);
        // A full day refills all of it, not more.
        let b = Bucket::full(shape, 0).take(shape, 0, 864).0;
        assert_eq!(b.refill(shape, 86_400_000 * 2).tokens(), 864);
    }

    #[test]
    fn clock_going_backwards_refills_nothing() {
        let b = Bucket::full(SHAPE, 10_000).take(SHAPE, 10_000, 5).0;
        let (_, t) = b.take(SHAPE, 5_000, 1);
        assert!(!t.admitted);
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let b = Bucket {
            level: -42,
            updated_ms: u64::MAX,
        };
        assert_eq!(Bucket::decode(&b.encode()), Some(b));
        assert_eq!(Bucket::decode(&[1, 2, 3]), None);
        assert_eq!(Bucket::decode(&[0; 17]), None);
    }

    #[test]
    fn debt_delays_admission() {
        let shape = Shape::per_minute(600, 100);
        let b = Bucket::full(shape, 0).charge(shape, 0, 150);
        assert_eq!(b.level, -50 * UNIT);
        let (_, t) = b.take(shape, 0, 1);
        assert!(!t.admitted);
        // 51 tokens at 10 per second.
        assert_eq!(t.wait_ms, 5100);
    }

    #[test]
    fn whole_tokens_round_down_in_debt_too() {
        let at = |level| Bucket {
            level,
            updated_ms: 0,
        };
        assert_eq!(at(5 * UNIT - 1).tokens(), 4);
        assert_eq!(at(5 * UNIT).tokens(), 5);
        assert_eq!(at(0).tokens(), 0);
        assert_eq!(at(-1).tokens(), -1);
        assert_eq!(at(-50 * UNIT).tokens(), -50);
    }

    #[test]
    fn huge_values_saturate() {
        let shape = Shape::per_minute(1_000_000_000, 1_000_000_000);
        let b = Bucket::full(shape, 0);
        let (_, t) = b.take(shape, u64::MAX, u64::MAX);
        assert!(!t.admitted);
    }
}
