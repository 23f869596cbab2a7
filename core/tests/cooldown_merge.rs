//! `cooldown::merge`, one row per rule, in the order it applies them: what a (pool, account)'s
//! record becomes when an answer asks for a cooldown (or gives no time). Each row states the
//! whole record before and after as values.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use llm_governor_core::classify::Class::{
    self, Overloaded, QuotaExhausted as Quota, RateLimited as Rl,
};
use llm_governor_core::cooldown::{merge, CooldownRecord, Pace, Wanted};

const NOW: u64 = 1_000_000;
const JITTER: f64 = 0.2;

/// A record: deadline, period, spread, class, streak, burst end (pace idle).
fn rec(
    deadline: u64,
    period: u32,
    spread: u32,
    class: Class,
    streak: u8,
    burst_end: u64,
) -> CooldownRecord {
    CooldownRecord {
        deadline_ms: deadline,
        period_ms: period,
        spread_ms: spread,
        class,
        streak,
        pace: Pace::default(),
        burst_end_ms: burst_end,
    }
}

fn want(class: Class, ms: u64) -> Option<Wanted> {
    Some(Wanted { class, ms })
}

/// (name, the record before, the cooldown asked for, the failed rounds, the record after).
type Row = (
    &'static str,
    Option<CooldownRecord>,
    Option<Wanted>,
    u8,
    CooldownRecord,
);

#[test]
fn each_rule_of_merge() {
    let pacing = Pace {
        active: true,
        ignore_remaining: false,
        credits: 3,
        out: 1,
        last_release_ms: NOW - 50,
        seq: 4,
    };
    #[rustfmt::skip]
    let rows: [Row; 9] = [
        // 1. No time given, nothing known: an idle record that only counts the streak.
        ("no time, no record", None, None, 2,
         rec(0, 0, 0, Rl, 2, 0)),
        // 2. No time given: the deadline stays, only the streak moves.
        ("no time, cooling", Some(rec(NOW + 5_000, 10_000, 10_000, Rl, 1, 0)), None, 3,
         rec(NOW + 5_000, 10_000, 10_000, Rl, 3, 0)),
        // 3. A first cooldown: from now, its period and spread the provider's time.
        ("first cooldown", None, want(Rl, 3_000), 1,
         rec(NOW + 3_000, 3_000, 3_000, Rl, 1, 0)),
        // 4. A shorter cooldown never shortens a running one: the later deadline is kept.
        ("shorter than running", Some(rec(NOW + 9_000, 10_000, 10_000, Rl, 1, 0)), want(Rl, 2_000), 2,
         rec(NOW + 9_000, 10_000, 10_000, Rl, 2, 0)),
        // 5. The same statement within its jitter band (another answer of one burst): the
        //    deadline stays, the burst's own end moves.
        ("same burst", Some(rec(NOW + 9_900, 10_000, 10_000, Rl, 1, 0)), want(Rl, 10_000), 1,
         rec(NOW + 9_900, 10_000, 10_000, Rl, 1, NOW + 10_000)),
        // 6. The same statement past the band: a new deadline, the episode's spread kept.
        ("past the band", Some(rec(NOW + 7_000, 10_000, 10_000, Rl, 1, 0)), want(Rl, 10_000), 1,
         rec(NOW + 10_000, 10_000, 10_000, Rl, 1, 0)),
        // 7. Soon after a cooldown ended (within its spread): the same episode, so a short
        //    cooldown keeps the episode's longest period as its spread.
        ("same episode", Some(rec(NOW - 4_000, 10_000, 10_000, Rl, 1, 0)), want(Rl, 1_000), 2,
         rec(NOW + 1_000, 1_000, 10_000, Rl, 2, 0)),
        // 8. Another class is another statement: a fresh cooldown, its own spread.
        ("other class", Some(rec(NOW + 1_000, 10_000, 10_000, Rl, 1, 0)), want(Quota, 300_000), 0,
         rec(NOW + 300_000, 300_000, 300_000, Quota, 0, 0)),
        // 9. Long after the episode: a fresh cooldown.
        ("long after", Some(rec(NOW - 20_000, 10_000, 10_000, Rl, 1, 0)), want(Rl, 1_000), 1,
         rec(NOW + 1_000, 1_000, 1_000, Rl, 1, 0)),
    ];
    for (name, old, wanted, streak, expected) in rows {
        assert_eq!(merge(old, wanted, streak, NOW, JITTER), expected, "{name}");
    }
    // A fresh cooldown keeps the pace the record had (the pace decides what follows it).
    let old = CooldownRecord {
        pace: pacing,
        ..rec(NOW - 20_000, 1_000, 1_000, Rl, 1, 0)
    };
    assert_eq!(
        merge(Some(old), want(Rl, 2_000), 2, NOW, JITTER).pace,
        pacing
    );
}

/// (name, the record before, the cooldown asked for, the failed rounds, the jitter, the record
/// after).
type Edge = (
    &'static str,
    Option<CooldownRecord>,
    Option<Wanted>,
    u8,
    f64,
    CooldownRecord,
);

/// The comparisons of the rules above (numbered as there), each at its edge: a row that a rule
/// with `<` for `<=`, or without one of its conditions, gets wrong.
#[test]
fn each_edge_of_its_rules() {
    #[rustfmt::skip]
    let rows: [Edge; 6] = [
        // Rule 4: the running deadline stays unless the new one is later; an equal one is not.
        ("the same deadline as running", Some(rec(NOW + 9_000, 10_000, 10_000, Rl, 1, 0)), want(Rl, 9_000), 2, JITTER,
         rec(NOW + 9_000, 10_000, 10_000, Rl, 2, 0)),
        // Rule 5: the band (here 2 s, a fifth of 10 s) includes its end.
        ("exactly one band later", Some(rec(NOW + 8_000, 10_000, 10_000, Rl, 1, 0)), want(Rl, 10_000), 1, JITTER,
         rec(NOW + 8_000, 10_000, 10_000, Rl, 1, NOW + 10_000)),
        // Rule 5: the same statement is the same class, not only the same period.
        ("the same period in another class", Some(rec(NOW + 9_900, 10_000, 10_000, Rl, 1, 0)), want(Overloaded, 10_000), 1, JITTER,
         rec(NOW + 10_000, 10_000, 10_000, Overloaded, 1, 0)),
        // Rule 5: only a running cooldown has a burst; one that ends now is over, even when a
        // band of a whole period would reach back to it.
        ("a cooldown ending now, at full jitter", Some(rec(NOW, 10_000, 10_000, Rl, 1, 0)), want(Rl, 10_000), 1, 1.0,
         rec(NOW + 10_000, 10_000, 10_000, Rl, 1, 0)),
        // Rule 7: an episode is one class; another one does not inherit its spread.
        ("another class soon after", Some(rec(NOW - 4_000, 10_000, 10_000, Rl, 1, 0)), want(Overloaded, 1_000), 2, JITTER,
         rec(NOW + 1_000, 1_000, 1_000, Overloaded, 2, 0)),
        // Rule 7: an episode lasts until the deadline plus its spread, and is over at that moment.
        ("the episode ending now", Some(rec(NOW - 10_000, 10_000, 10_000, Rl, 1, 0)), want(Rl, 1_000), 1, JITTER,
         rec(NOW + 1_000, 1_000, 1_000, Rl, 1, 0)),
    ];
    for (name, old, wanted, streak, jitter, expected) in rows {
        assert_eq!(merge(old, wanted, streak, NOW, jitter), expected, "{name}");
    }
}
