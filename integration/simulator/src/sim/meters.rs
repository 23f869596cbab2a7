//! The provider's own meters beyond `tpm`, each a per-key token bucket refilled continuously
//! over its window, as the providers document them: Anthropic's input tokens per minute (ITPM:
//! uncached input plus cache writes, `prompt_cache`), its output tokens per minute (OTPM: the
//! tokens generated, charged as produced, so a bucket may go into debt; a request is admitted
//! while the bucket holds a token), and OpenAI's requests and tokens per day (RPD, TPD: counted
//! at admission like its TPM). Answers report their levels in the rate-limit headers.

use std::collections::HashMap;
use std::time::Instant;

use crate::decision::{Limits, Reason};
use crate::scenario::{Dimension, Scenario};

const MINUTE_NS: i128 = 60_000_000_000;
const DAY_NS: i128 = 86_400 * 1_000_000_000;

/// One key's bucket of one meter: `level` in units of 1 / `period_ns` token at `at`.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: i128,
    at: Instant,
}

/// A meter's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub capacity: u64,
    period_ns: i128,
}

impl Shape {
    fn minute(capacity: u64) -> Shape {
        Shape {
            capacity: capacity.max(1),
            period_ns: MINUTE_NS,
        }
    }
    fn day(capacity: u64) -> Shape {
        Shape {
            capacity: capacity.max(1),
            period_ns: DAY_NS,
        }
    }
    fn full(&self) -> i128 {
        i128::from(self.capacity) * self.period_ns
    }
    fn units(&self, tokens: u64) -> i128 {
        i128::from(tokens) * self.period_ns
    }
}

impl Bucket {
    fn level(&self, s: Shape, now: Instant) -> i128 {
        let elapsed = now.saturating_duration_since(self.at).as_nanos() as i128;
        (self.level + elapsed * i128::from(s.capacity)).min(s.full())
    }

    /// How long until `count` tokens are there (0: now; None: never, over the capacity).
    fn wait_ms(&self, s: Shape, now: Instant, count: u64) -> Option<u64> {
        if count > s.capacity {
            return None;
        }
        let short = s.units(count) - self.level(s, now);
        if short <= 0 {
            return Some(0);
        }
        let ns = short.div_euclid(i128::from(s.capacity)) + 1;
        Some(u64::try_from(ns.div_euclid(1_000_000) + 1).unwrap_or(u64::MAX))
    }

    fn charge(&mut self, s: Shape, now: Instant, count: u64) {
        let level = self.level(s, now);
        self.level = level - s.units(count);
        self.at = self.at.max(now);
    }

    /// (whole tokens left, ms until full).
    fn report(&self, s: Shape, now: Instant) -> (u64, u64) {
        let level = self.level(s, now);
        let left = u64::try_from(level.max(0) / s.period_ns).unwrap_or(0);
        let to_full = (s.full() - level).max(0) / i128::from(s.capacity);
        (
            left,
            u64::try_from(to_full.div_euclid(1_000_000)).unwrap_or(u64::MAX),
        )
    }
}

/// What each meter counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// ITPM: uncached input plus cache writes.
    pub input: u64,
    /// OTPM: the tokens it will generate.
    pub output: u64,
    /// TPD: its admission count (input estimate plus output limit), as TPM counts it.
    pub admission: u64,
}

/// A request one meter refuses: why, the dimension reported used up, and when it would fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    pub dimension: Dimension,
    pub wait_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Meter {
    Input,
    Output,
    RequestsPerDay,
    TokensPerDay,
}

/// Every key's buckets of every meter.
#[derive(Default)]
pub struct Meters(HashMap<(String, Meter), Bucket>);

fn shapes(sc: &Scenario) -> [(Meter, Option<Shape>); 4] {
    [
        (
            Meter::Input,
            sc.itpm.as_ref().map(|m| Shape::minute(m.tokens)),
        ),
        (
            Meter::Output,
            sc.otpm.as_ref().map(|m| Shape::minute(m.tokens)),
        ),
        (
            Meter::RequestsPerDay,
            sc.rpd.as_ref().map(|m| Shape::day(m.requests)),
        ),
        (
            Meter::TokensPerDay,
            sc.tpd.as_ref().map(|m| Shape::day(m.tokens)),
        ),
    ]
}

impl Meters {
    fn bucket(&mut self, key: &str, m: Meter, s: Shape, now: Instant) -> &mut Bucket {
        self.0
            .entry((key.to_string(), m))
            .or_insert_with(|| Bucket {
                level: s.full(),
                at: now,
            })
    }

    /// The first meter that refuses the request now, if any. Charges nothing.
    pub fn check(&mut self, sc: &Scenario, key: &str, c: Counts, now: Instant) -> Option<Refusal> {
        for (m, shape) in shapes(sc) {
            let Some(s) = shape else { continue };
            let (need, reason, dimension) = match m {
                Meter::Input => (
                    c.input,
                    Reason::InputTokensExhausted,
                    Dimension::InputTokens,
                ),
                // Output is counted as generated: a request goes while a token is left.
                Meter::Output => (1, Reason::OutputTokensExhausted, Dimension::OutputTokens),
                Meter::RequestsPerDay => (1, Reason::DayExhausted, Dimension::Requests),
                Meter::TokensPerDay => (c.admission, Reason::DayExhausted, Dimension::Tokens),
            };
            let b = self.bucket(key, m, s, now);
            match b.wait_ms(s, now, need) {
                Some(0) => {}
                Some(wait_ms) => {
                    return Some(Refusal {
                        reason,
                        dimension,
                        wait_ms,
                    })
                }
                // Never fits: told to come back when the bucket is full, as the provider does.
                None => {
                    return Some(Refusal {
                        reason,
                        dimension,
                        wait_ms: b.report(s, now).1.max(1),
                    })
                }
            }
        }
        None
    }

    /// A served request is charged to every meter.
    pub fn charge(&mut self, sc: &Scenario, key: &str, c: Counts, now: Instant) {
        for (m, shape) in shapes(sc) {
            let Some(s) = shape else { continue };
            let count = match m {
                Meter::Input => c.input,
                Meter::Output => c.output,
                Meter::RequestsPerDay => 1,
                Meter::TokensPerDay => c.admission,
            };
            self.bucket(key, m, s, now).charge(s, now, count);
        }
    }

    /// The rate-limit values the answer reports: Anthropic's input and output dimensions from
    /// their meters (and its combined `tokens` dimension as the scarcer of the two, when no
    /// `tpm` says otherwise).
    pub fn report(&mut self, sc: &Scenario, key: &str, limits: &mut Limits, now: Instant) {
        let mut scarcest: Option<(u64, u64, u64)> = None;
        for (m, shape) in shapes(sc) {
            let Some(s) = shape else { continue };
            let (left, reset) = self.bucket(key, m, s, now).report(s, now);
            match m {
                Meter::Input => {
                    limits.limit_input_tokens = s.capacity;
                    limits.remaining_input_tokens = left;
                    limits.reset_input_tokens_ms = reset;
                }
                Meter::Output => {
                    limits.limit_output_tokens = s.capacity;
                    limits.remaining_output_tokens = left;
                    limits.reset_output_tokens_ms = reset;
                }
                _ => continue,
            }
            if scarcest.map_or(true, |(l, _, _)| left < l) {
                scarcest = Some((left, s.capacity, reset));
            }
        }
        if let (Some((left, capacity, reset)), None) = (scarcest, &sc.tpm) {
            limits.limit_tokens = capacity;
            limits.remaining_tokens = left;
            limits.reset_tokens_ms = reset;
        }
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sim::testing::scenario;

    #[test]
    fn input_counts_output_goes_into_debt_days_refill_over_a_day() {
        let sc =
            scenario(r#"{"itpm":{"tokens":20000},"otpm":{"tokens":6000},"rpd":{"requests":2}}"#);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut m = Meters::default();
        let c = Counts {
            input: 15_000,
            output: 7_000,
            admission: 0,
        };
        assert_eq!(m.check(&sc, "k", c, t0), None);
        m.charge(&sc, "k", c, t0);
        // 5,000 input left: 15,000 more take 30 s (333.3 a second).
        let r = m.check(&sc, "k", c, t0).unwrap();
        assert_eq!(
            (r.reason, r.dimension),
            (Reason::InputTokensExhausted, Dimension::InputTokens)
        );
        assert!((30_000..=30_001).contains(&r.wait_ms), "{r:?}");
        // Output went 1,000 into debt: nothing goes until it is repaid and a token is back.
        let small = Counts {
            input: 10,
            output: 10,
            ..c
        };
        let r = m.check(&sc, "k", small, at(1)).unwrap();
        assert_eq!(r.reason, Reason::OutputTokensExhausted);
        assert!((10_000..=10_011).contains(&r.wait_ms), "{r:?}");
        assert!(m.check(&sc, "k", small, at(10_020)).is_none());
        let mut limits = Limits::default();
        m.report(&sc, "k", &mut limits, at(10_020));
        assert_eq!(limits.limit_output_tokens, 6_000);
        assert_eq!(limits.remaining_output_tokens, 2);
        // Two requests a day: the third waits about half a day (one comes back every 12 h).
        m.charge(&sc, "k", small, at(20_000));
        let r = m.check(&sc, "k", small, at(20_000)).unwrap();
        assert_eq!(
            (r.reason, r.dimension),
            (Reason::DayExhausted, Dimension::Requests)
        );
        assert!((43_180_000..=43_200_000).contains(&r.wait_ms), "{r:?}");
        assert!(m.check(&sc, "k", small, at(86_400_000)).is_none());
    }
}
