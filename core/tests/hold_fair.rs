//! Who goes first among held requests (issue 33): `hold.fair_key` shares releases by value,
//! `hold.classes` by weight, each class with its own longest hold and bound; the same order
//! for every wait, and a request whose turn cannot come in time is told its turn at once.
//! One worker through the fake host, one table row per case.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::provider::{A, PATH};
use common::reactions::set_headers;
use common::{answered, cool, flows, go, gone, header, tick_all, Host, Step};
use llm_governor_core::cooldown::CLOCK_GRAIN_MS as GRAIN;
use llm_governor_core::metrics::{ClassStat, Counter, Gauge, Write};

const POOLS: &str = r#""pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}}]"#;

fn cfg(hold: &str) -> String {
    format!(r#"{{{POOLS}, "hold": {{{hold}}}}}"#)
}

const FAIR: &str = r#""fair_key": "header:x-tenant-id""#;

/// Chat is interactive (weight `w`), the rest batch.
fn classes(w: u32) -> String {
    format!(
        r#"{FAIR}, "classes": [
          {{"name": "interactive", "match": {{"header": {{"name": "x-tenant-id", "value": "chat"}}}}, "weight": {w}}},
          {{"name": "batch", "weight": 1}}]"#
    )
}

fn tenant(t: &str) -> [(&str, &str); 2] {
    [A, ("x-tenant-id", t)]
}

fn held(step: Step) {
    assert!(matches!(step, Step::Held), "expected held, got {step:?}");
}

/// Cool account A for 1 s, hold `arrivals` (id, tenant) in that order, end the cooldown, and
/// let the probe's answer make room for all of them: the order the worker lets them go.
fn release_order(config: &str, arrivals: &[(u32, &str)]) -> Vec<u32> {
    let mut host = Host::new(config);
    cool(&mut host, "1");
    for &(id, t) in arrivals {
        held(host.arrive(id, PATH, &tenant(t)));
    }
    host.advance(1_000 + GRAIN);
    let probe = flows(host.tick());
    assert_eq!(probe.len(), 1, "one probe");
    let room = arrivals.len().to_string();
    host.respond(
        &probe[0].1,
        200,
        &[("x-ratelimit-remaining-requests", &room)],
        "",
    );
    let mut order = vec![probe[0].0];
    order.extend(gone(&tick_all(&mut host)));
    order
}

#[test]
fn each_release_goes_to_the_next_value_in_turn_and_classes_share_by_weight() {
    let mixed: &[(u32, &str)] = &[
        (1, "batch"),
        (2, "batch"),
        (3, "batch"),
        (4, "batch"),
        (5, "chat"),
        (6, "batch"),
        (7, "chat"),
    ];
    let chatty: &[(u32, &str)] = &[
        (1, "batch"),
        (2, "batch"),
        (3, "batch"),
        (4, "batch"),
        (5, "chat"),
        (6, "chat"),
        (7, "chat"),
        (8, "chat"),
        (9, "chat"),
        (10, "chat"),
    ];
    let three: &[(u32, &str)] = &[
        (1, "a"),
        (2, "a"),
        (3, "a"),
        (4, "b"),
        (5, "b"),
        (6, "c"),
        (7, "a"),
    ];
    type Row<'a> = (&'a str, String, &'a [(u32, &'a str)], &'a [u32]);
    let rows: [Row; 7] = [
        (
            "no fair key: arrival order",
            cfg(""),
            mixed,
            &[1, 2, 3, 4, 5, 6, 7],
        ),
        (
            "fair key: chat and batch take turns, arrival order within each",
            cfg(FAIR),
            mixed,
            &[1, 5, 2, 7, 3, 4, 6],
        ),
        (
            "three values in turn; a value that runs out leaves the turns",
            cfg(FAIR),
            three,
            &[1, 4, 6, 2, 5, 3, 7],
        ),
        (
            "classes 2:1: two interactive releases per batch one",
            cfg(&classes(2)),
            chatty,
            &[1, 5, 6, 2, 7, 8, 3, 9, 10, 4],
        ),
        (
            "classes 1:1 are a fair share",
            cfg(&classes(1)),
            chatty,
            &[1, 5, 2, 6, 3, 7, 4, 8, 9, 10],
        ),
        (
            "an idle class's share goes to the others",
            cfg(&classes(9)),
            &[(1, "batch"), (2, "batch"), (3, "other")],
            &[1, 3, 2],
        ),
        (
            "a heavy weight is a share, not a starvation",
            cfg(&classes(1000)),
            &[(1, "batch"), (2, "batch"), (3, "chat")],
            &[1, 3, 2],
        ),
    ];
    for (what, config, arrivals, want) in rows {
        assert_eq!(release_order(&config, arrivals), want, "{what}");
    }
}

#[test]
fn a_values_own_empty_bucket_stops_that_value_only() {
    // Each tenant has its own bucket (1 a second, burst 1): a's is empty, so a waits; b's is
    // full. Without a fair key b queues behind a (arrival order); with one it goes at once.
    let limit = r#""limits": [{"name": "rps", "key": "header:x-tenant-id", "requests_per_minute": 60, "burst": 1}]"#;
    let rows = [
        ("arrival order", "", Vec::<u32>::new()),
        ("fair key", FAIR, vec![3]),
    ];
    for (what, hold, want) in rows {
        let mut host = Host::new(&format!(r#"{{{POOLS}, {limit}, "hold": {{{hold}}}}}"#));
        go(host.arrive(1, PATH, &tenant("a")));
        held(host.arrive(2, PATH, &tenant("a")));
        held(host.arrive(3, PATH, &tenant("b")));
        host.advance(20);
        assert_eq!(gone(&host.tick()), want, "{what}");
        host.advance(980);
        let rest: Vec<u32> = [2, 3].into_iter().filter(|id| !want.contains(id)).collect();
        assert_eq!(gone(&host.tick()), rest, "{what}: after a's refill");
    }
}

#[test]
fn a_request_whose_turn_cannot_come_in_time_is_told_its_turn_at_the_fair_share_rate() {
    // One request a second for the pool (burst 1); tenant a has six held. Tenant b's request
    // with 2.5 s to wait: its turn comes after a's first (the turns alternate), in 2 s. In
    // arrival order it comes after all six: answered at once, told 7 s.
    let limit =
        r#""limits": [{"name": "rps", "key": "pool", "requests_per_minute": 60, "burst": 1}]"#;
    let short = [
        A,
        ("x-tenant-id", "b"),
        ("x-envoy-expected-rq-timeout-ms", "4500"),
    ];
    let rows = [
        ("arrival order", "", Some("7000")),
        ("fair key", FAIR, None),
    ];
    for (what, hold, told) in rows {
        let mut host = Host::new(&format!(r#"{{{POOLS}, {limit}, "hold": {{{hold}}}}}"#));
        go(host.arrive(1, PATH, &tenant("a")));
        for id in 2..=7 {
            held(host.arrive(id, PATH, &tenant("a")));
        }
        match (host.arrive(8, PATH, &short), told) {
            (Step::Reply(r), Some(ms)) => {
                assert_eq!(header(&r.headers, "retry-after-ms"), ms, "{what}")
            }
            (Step::Held, None) => {}
            (step, _) => panic!("{what}: {step:?}"),
        }
    }
    // Answered at the deadline, a held request is told its own turn, not the queue's end.
    let mut host = Host::new(&format!(r#"{{{POOLS}, {limit}, "hold": {{{FAIR}}}}}"#));
    go(host.arrive(1, PATH, &tenant("a")));
    for id in 2..=7 {
        held(host.arrive(id, PATH, &tenant("a")));
    }
    let mid = [
        A,
        ("x-tenant-id", "a"),
        ("x-envoy-expected-rq-timeout-ms", "9000"),
    ];
    held(host.arrive(8, PATH, &mid));
    held(host.arrive(9, PATH, &tenant("b")));
    host.advance(1_000);
    assert_eq!(gone(&host.tick()), [2], "a's first, then b's turn");
    host.advance(1_000);
    assert_eq!(gone(&host.tick()), [9]);
    host.advance(5_000); // 8's 7 s deadline: a's 3 goes now, 4 to 7 are still ahead of it
    let out = host.tick();
    assert_eq!(answered(&out), [8]);
    let Step::Reply(r) = &out.iter().find(|(id, _)| *id == 8).unwrap().1 else {
        panic!("a local answer");
    };
    assert_eq!(header(&r.headers, "retry-after-ms"), "5000");
}

#[test]
fn each_class_has_its_own_longest_hold_and_bound() {
    let config = cfg(&format!(
        r#"{FAIR}, "classes": [
          {{"name": "interactive", "match": {{"header": {{"name": "x-tenant-id", "value": "chat"}}}}, "max_ms": 5000, "max_held": 1}},
          {{"name": "batch", "max_ms": 120000}}]"#
    ));
    let mut host = Host::new(&config);
    cool(&mut host, "30");
    // A 30 s cooldown: batch holds through it, chat (5 s at most) is answered at once.
    held(host.arrive(1, PATH, &tenant("batch")));
    let Step::Reply(r) = host.arrive(2, PATH, &tenant("chat")) else {
        panic!("chat cannot wait 30 s");
    };
    assert_eq!(
        header(&r.headers, "x-llm-governor-hold-class"),
        "interactive"
    );
    assert_eq!(header(&r.headers, "x-llm-governor-source"), "cooldown");
    // Chat's bound is one held request.
    let mut host = Host::new(&config);
    cool(&mut host, "2");
    held(host.arrive(1, PATH, &tenant("chat")));
    assert!(matches!(
        host.arrive(2, PATH, &tenant("chat")),
        Step::Reply(_)
    ));
    held(host.arrive(3, PATH, &tenant("batch")));
    host.advance(2_000 + GRAIN);
    let probe = flows(host.tick());
    assert_eq!(probe[0].0, 1);
    let told = set_headers(&host.response(&probe[0].1, 200, &[], "")[0]);
    assert_eq!(header(&told, "x-llm-governor-hold-class"), "interactive");
    assert_eq!(
        header(&told, "x-llm-governor-held-ms"),
        (2_000 + GRAIN).to_string()
    );
}

#[test]
fn a_client_never_picks_its_own_class_or_joins_another_value_by_what_the_operator_does_not_match() {
    // Only the operator's match decides: a client naming a class, or sending the header a
    // class matches with another value, is batch.
    let config = cfg(&classes(9));
    for headers in [
        vec![A, ("x-llm-governor-hold-class", "interactive")],
        vec![A, ("x-tenant-id", "chat ")],
        vec![A, ("x-tenant-id", "CHAT")],
    ] {
        let mut host = Host::new(&config);
        cool(&mut host, "30");
        let Step::Reply(r) = host.arrive(1, PATH, &headers) else {
            panic!("answered: 30 s is past the hold");
        };
        assert_eq!(
            header(&r.headers, "x-llm-governor-hold-class"),
            "batch",
            "{headers:?}"
        );
    }
}

#[test]
fn fair_key_values_past_max_keys_share_one_overflow_value() {
    // max_keys 2: a and b have values of their own; c and d share the overflow value, which
    // takes its turns as one.
    let config = format!(r#"{{{POOLS}, "max_keys": 2, "hold": {{{FAIR}}}}}"#);
    let arrivals: &[(u32, &str)] = &[(1, "a"), (2, "a"), (3, "b"), (4, "c"), (5, "d"), (6, "a")];
    assert_eq!(release_order(&config, arrivals), [1, 3, 4, 2, 5, 6]);
    let mut host = Host::new(&config);
    cool(&mut host, "1");
    for &(id, t) in arrivals {
        held(host.arrive(id, PATH, &tenant(t)));
    }
    assert_eq!(host.metrics.count_of(0, Counter::OverflowKeys), 2);
}

#[test]
fn class_stats_count_held_released_and_answered_requests_and_the_gauge_returns_to_zero() {
    let mut host = Host::new(&cfg(&classes(2)));
    cool(&mut host, "1");
    held(host.arrive(1, PATH, &tenant("chat")));
    held(host.arrive(2, PATH, &tenant("batch")));
    held(host.arrive(3, PATH, &tenant("batch")));
    let (chat, batch) = (0, 1);
    assert_eq!(
        host.metrics.class_total(0, chat, ClassStat::HeldRequests),
        1
    );
    assert_eq!(
        host.metrics.class_total(0, batch, ClassStat::HeldRequests),
        2
    );
    host.advance(1_000 + GRAIN);
    let probe = flows(host.tick());
    host.respond(
        &probe[0].1,
        200,
        &[("x-ratelimit-remaining-requests", "1")],
        "",
    );
    assert_eq!(gone(&tick_all(&mut host)), [2]);
    host.end(3);
    let m = &host.metrics;
    let rows = [
        (chat, ClassStat::Held, 1),
        (chat, ClassStat::Released, 1),
        (batch, ClassStat::Held, 2),
        (batch, ClassStat::Released, 1),
        (batch, ClassStat::Expired, 0),
        (chat, ClassStat::HeldRequests, 0),
        (batch, ClassStat::HeldRequests, 0),
        (chat, ClassStat::HoldMs, 1),
        (batch, ClassStat::HoldMs, 1),
    ];
    for (class, stat, want) in rows {
        assert_eq!(m.class_total(0, class, stat), want, "{class} {stat:?}");
    }
    assert_eq!(m.sum(0, Gauge::HeldRequests), 0);
    assert_eq!(m.count_of(0, Counter::HoldReleased), 2);
    // Each class's longest hold, set as its requests are held: what its hold time reads against.
    let limits: Vec<(usize, Write)> = m
        .classes
        .iter()
        .filter(|(_, _, s, _)| *s == ClassStat::HoldLimitMs)
        .map(|(_, c, _, w)| (*c, *w))
        .collect();
    let ten_s = Write::Set(10_000);
    assert_eq!(limits, [(chat, ten_s), (batch, ten_s), (batch, ten_s)]);
}

#[test]
fn without_classes_nothing_is_counted_by_class_and_no_class_is_told() {
    let mut host = Host::new(&cfg(FAIR));
    cool(&mut host, "30");
    let Step::Reply(r) = host.arrive(1, PATH, &tenant("chat")) else {
        panic!("answered");
    };
    assert!(r
        .headers
        .iter()
        .all(|(n, _)| *n != "x-llm-governor-hold-class"));
    assert!(host.metrics.classes.is_empty());
}
