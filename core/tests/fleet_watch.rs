//! What a worker watches of the fleet's cooldowns (`fleet::watch`): the fleet's marker from the
//! start, one check for all the workers of an Envoy; a (pool, account)'s marker (on a request's
//! way, from the timer) only while the fleet's says something cools; what the timer marks and
//! how often, and what is forgotten.

#![allow(clippy::unwrap_used)]

use llm_governor_core::fleet::turn::TurnKey;
use llm_governor_core::fleet::watch::{
    Here, Look, Watch, LINGER_MS, MARK_MS, MAX_WATCHED, PEEK_MS, STALE_MS, WATCH_MS,
};
use llm_governor_core::store::MemStore;

const T0: u64 = 1_800_000_000_000;

fn key(account: u64) -> TurnKey {
    TurnKey { pool: 0, account }
}

/// The calls `w` owes over `ms` from `from`, its timer looking every 10 ms.
fn looks(
    w: &mut Watch,
    s: &MemStore,
    from: u64,
    ms: u64,
    here: impl Fn(TurnKey) -> Here,
) -> Vec<Look> {
    (10..=ms)
        .step_by(10)
        .flat_map(|t| w.due(from + t, s, &here))
        .collect()
}

fn count(looks: &[Look], look: Look) -> usize {
    looks.iter().filter(|l| **l == look).count()
}

#[test]
fn while_nothing_cools_no_request_checks_on_its_way() {
    let (mut w, s) = (Watch::new(true), MemStore::default());
    assert!(!w.sent(key(1), T0, &s), "nothing is known to cool");
    w.answered(Some(false), T0 + 1, &s);
    assert!(!w.sent(key(1), T0 + 2, &s));
    assert!(
        !w.sent(key(2), T0 + 3, &s),
        "a (pool, account) never sent to"
    );
    w.answered(None, T0 + 4, &s);
    assert!(
        !w.sent(key(3), T0 + 5, &s),
        "a failed check changes nothing"
    );
    assert!(!w.cools(T0 + 5, &s));
}

#[test]
fn while_something_cools_a_request_checks_on_its_way_until_its_check_is_answered() {
    let (mut w, s) = (Watch::new(true), MemStore::default());
    w.sent(key(1), T0, &s);
    w.answered(Some(true), T0 + 10, &s);
    assert!(
        w.sent(key(1), T0 + 11, &s),
        "not checked since something cools"
    );
    assert!(
        w.sent(key(1), T0 + 12, &s),
        "the first check is not answered yet"
    );
    w.checked(key(1), || T0 + 13);
    assert!(!w.sent(key(1), T0 + 14, &s));
    let last = T0 + 13 + STALE_MS - 1;
    assert!(!w.sent(key(1), last, &s));
    w.answered(Some(true), last, &s);
    assert!(w.sent(key(1), last + 1, &s), "no check for STALE_MS");
    // The fleet's marker is not found again: after LINGER_MS nothing is known to cool.
    assert!(w.cools(last + LINGER_MS - 1, &s));
    assert!(!w.sent(key(1), last + LINGER_MS, &s));
}

#[test]
fn the_timer_checks_the_fleets_marker_from_the_start_and_an_account_only_while_something_cools() {
    let (mut w, s) = (Watch::new(true), MemStore::default());
    assert_eq!(w.next_check_ms(), Some(PEEK_MS), "due at once");
    assert_eq!(w.due(T0, &s, |_| Here::Quiet), vec![Look::PeekAny]);
    assert_eq!(w.next_check_ms(), Some(T0 + PEEK_MS));
    for k in 1..=3 {
        w.sent(key(k), T0, &s);
    }
    let here = |k: TurnKey| match k.account {
        1 => Here::Quiet,
        2 => Here::Cools,
        _ => Here::Paces,
    };
    let quiet = looks(&mut w, &s, T0, 1_000, here);
    assert_eq!(count(&quiet, Look::PeekAny), 10);
    assert_eq!(count(&quiet, Look::Peek(key(1))), 0, "nothing cools");
    // Marked at the first look (never marked yet), then at the first look MARK_MS after the
    // last mark: 10, 310, 610 and 910 ms, well within the marker's one-second window.
    assert_eq!(count(&quiet, Look::Mark(key(2))), 4, "MARK_MS {MARK_MS}");
    // The fleet's marker is found: the quiet account is checked at once, then every PEEK_MS;
    // the one that paces here is not.
    assert!(w.answered(Some(true), T0 + 1_005, &s), "newly found");
    let cooling = looks(&mut w, &s, T0 + 1_000, 200, here);
    assert_eq!(count(&cooling, Look::Peek(key(1))), 2, "{cooling:?}");
    assert_eq!(count(&cooling, Look::Peek(key(3))), 0);
}

#[test]
fn the_workers_of_an_envoy_share_one_check_and_what_it_found() {
    let s = MemStore::default();
    let (mut a, mut b) = (Watch::new(true), Watch::new(true));
    b.sent(key(1), T0, &s);
    let mut checks = 0;
    for t in (0..1_000).step_by(10) {
        for w in [&mut a, &mut b] {
            checks += count(&w.due(T0 + t, &s, |_| Here::Quiet), Look::PeekAny);
        }
    }
    assert_eq!(
        checks, 10,
        "one check per PEEK_MS for the Envoy, not per worker"
    );
    // Worker `a`'s check finds the marker: `b` knows it too, and checks its account on its next
    // look, and a request of it checks on its way.
    a.answered(Some(true), T0 + 1_000, &s);
    assert!(b.cools(T0 + 1_001, &s));
    assert!(b.sent(key(1), T0 + 1_001, &s));
    let next = looks(&mut b, &s, T0 + 1_000, PEEK_MS, |_| Here::Quiet);
    assert_eq!(count(&next, Look::Peek(key(1))), 1, "{next:?}");
}

#[test]
fn without_shared_cooldowns_nothing_is_watched() {
    let (mut w, s) = (Watch::new(false), MemStore::default());
    assert!(w.is_empty());
    assert_eq!(w.next_check_ms(), None);
    assert!(w.due(T0, &s, |_| Here::Quiet).is_empty());
    assert!(!w.sent(key(1), T0, &s));
}

#[test]
fn a_cooldown_learned_here_is_marked_at_once_then_no_more_than_every_mark_ms() {
    let mut w = Watch::new(true);
    assert!(w.learned(key(1), T0), "a key never sent to is marked too");
    assert!(
        !w.learned(key(1), T0 + 1),
        "the rest of the burst's answers"
    );
    assert!(!w.learned(key(1), T0 + MARK_MS - 1));
    assert!(w.learned(key(1), T0 + MARK_MS));
}

#[test]
fn what_was_not_sent_to_for_a_minute_is_forgotten_and_the_watch_is_bounded() {
    let (mut w, s) = (Watch::new(true), MemStore::default());
    for k in 0..(MAX_WATCHED as u64 + 10) {
        w.sent(key(k), T0 + k, &s);
    }
    w.answered(Some(true), T0 + 1_000, &s);
    let looks = w.due(T0 + 1_000, &s, |_| Here::Quiet);
    assert_eq!(
        looks.len(),
        MAX_WATCHED + 1,
        "the least recently sent to went"
    );
    assert!(!looks.contains(&Look::Peek(key(0))));
    assert!(looks.contains(&Look::Peek(key(MAX_WATCHED as u64 + 9))));
    let later = T0 + 50 + WATCH_MS;
    w.answered(Some(true), later, &s);
    assert_eq!(w.due(later, &s, |_| Here::Quiet), vec![Look::PeekAny]);
    assert_eq!(
        w.next_check_ms(),
        Some(later + PEEK_MS),
        "only the fleet's marker"
    );
}

#[test]
fn a_cooldown_longer_than_the_watch_is_marked_to_its_end() {
    let (mut w, s) = (Watch::new(true), MemStore::default());
    w.sent(key(1), T0, &s);
    let later = T0 + WATCH_MS + 1_000;
    let looks = w.due(later, &s, |_| Here::Cools);
    assert_eq!(looks, vec![Look::PeekAny, Look::Mark(key(1))]);
    w.answered(Some(true), later, &s);
    assert_eq!(
        w.due(later + 2 * PEEK_MS, &s, |_| Here::Quiet),
        vec![Look::PeekAny],
        "over: forgotten"
    );
}
