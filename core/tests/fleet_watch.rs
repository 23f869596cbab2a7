//! What a worker watches of the fleet's cooldowns (`fleet::watch`): when a request checks the
//! marker on its way, what the timer checks or marks and how often, and what is forgotten.

#![allow(clippy::unwrap_used)]

use llm_governor_core::fleet::turn::TurnKey;
use llm_governor_core::fleet::watch::{
    Here, Look, Watch, MARK_MS, MAX_WATCHED, PEEK_MS, STALE_MS, WATCH_MS,
};

const T0: u64 = 1_800_000_000_000;

fn key(account: u64) -> TurnKey {
    TurnKey { pool: 0, account }
}

#[test]
fn a_request_checks_on_its_way_until_a_check_is_answered_and_again_once_it_is_stale() {
    let mut w = Watch::default();
    assert!(w.sent(key(1), T0), "never checked");
    assert!(
        w.sent(key(1), T0 + 1),
        "the first check is not answered yet"
    );
    w.checked(key(1), T0 + 2);
    assert!(!w.sent(key(1), T0 + 3));
    assert!(!w.sent(key(1), T0 + 2 + STALE_MS - 1));
    assert!(w.sent(key(1), T0 + 2 + STALE_MS), "no check for STALE_MS");
}

#[test]
fn the_timer_checks_what_is_quiet_here_marks_what_cools_and_leaves_what_paces() {
    let mut w = Watch::default();
    for k in 1..=3 {
        w.sent(key(k), T0);
        w.checked(key(k), T0);
    }
    let here = |k: TurnKey| match k.account {
        1 => Here::Quiet,
        2 => Here::Cools,
        _ => Here::Paces,
    };
    let (mut peeks, mut marks) = (0, 0);
    assert_eq!(w.next_check_ms(), Some(T0 + PEEK_MS));
    for ms in (10..=1_000).step_by(10) {
        for look in w.due(T0 + ms, here) {
            match look {
                Look::Peek(k) => {
                    assert_eq!(k, key(1));
                    peeks += 1;
                }
                Look::Mark(k) => {
                    assert_eq!(k, key(2));
                    marks += 1;
                }
            }
        }
    }
    assert_eq!(peeks, 1_000 / PEEK_MS);
    // Looked at every PEEK_MS; marked at the first look (never marked yet), then at the first
    // look MARK_MS after the last mark: 100, 400, 700 and 1,000 ms, well within the marker's
    // one-second window.
    assert_eq!(marks, 4, "MARK_MS {MARK_MS}");
}

#[test]
fn a_cooldown_learned_here_is_marked_at_once_then_no_more_than_every_mark_ms() {
    let mut w = Watch::default();
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
    let mut w = Watch::default();
    for k in 0..(MAX_WATCHED as u64 + 10) {
        w.sent(key(k), T0 + k);
    }
    let looks = w.due(T0 + 1_000, |_| Here::Quiet);
    assert_eq!(looks.len(), MAX_WATCHED, "the least recently sent to went");
    assert!(!looks.contains(&Look::Peek(key(0))));
    assert!(looks.contains(&Look::Peek(key(MAX_WATCHED as u64 + 9))));
    assert!(w.due(T0 + 50 + WATCH_MS, |_| Here::Quiet).is_empty());
    assert!(w.is_empty());
    assert_eq!(w.next_check_ms(), None);
}

#[test]
fn a_cooldown_longer_than_the_watch_is_marked_to_its_end() {
    let mut w = Watch::default();
    w.sent(key(1), T0);
    let later = T0 + WATCH_MS + 1_000;
    assert_eq!(w.due(later, |_| Here::Cools), vec![Look::Mark(key(1))]);
    assert!(
        w.due(later + 2 * PEEK_MS, |_| Here::Quiet).is_empty(),
        "over: forgotten"
    );
    assert!(w.is_empty());
}
