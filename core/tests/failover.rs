//! Cooldown-aware failover: a cooling, out-of-quota or capped (pool, account) steers its
//! requests, before they are sent, to the first fallback that can take them.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::provider::{A, B, PATH, QUOTA, RL};
use common::Step;
use common::{flows, go, header, Host};
use llm_governor_core::config;
use llm_governor_core::cooldown::CLOCK_GRAIN_MS as GRAIN;
use llm_governor_core::metrics::{Counter, Gauge};

const CFG: &str = r#"{"pools": [
  {"name": "primary", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai", "fallback": ["backup"]},
  {"name": "backup", "match": {"header": {"name": "x-never", "value": "x"}}, "dialect": "openai", "account": "backup-key"}
]}"#;
const PRIMARY: usize = 0;
const BACKUP: usize = 1;

#[test]
fn a_cooling_primary_steers_to_the_fallback_which_governs_from_then_on() {
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[A]);
    assert_eq!(host.governor().pools().steered_to(&f), None);
    host.respond(&f, 429, &[("retry-after", "5")], RL);
    let steered = go(host.arrive(1, PATH, &[A]));
    assert_eq!(host.governor().pools().steered_to(&steered), Some("backup"));
    assert_eq!(steered.pool, BACKUP);
    // The fallback's account is its label, hashed like a credential: never the client's key.
    assert_eq!(steered.account, host.governor().id(b"backup-key"));
    assert_eq!(host.metrics.count_of(PRIMARY, Counter::Failover), 1);
    // Another account of the primary is not steered.
    let other = go(host.arrive(2, PATH, &[B]));
    assert_eq!(other.pool, PRIMARY);
    // A 429 from the fallback cools the fallback's (pool, account), counted on its stats; its
    // client is told where it was steered.
    let g = host
        .respond(&steered, 429, &[("retry-after", "2")], RL)
        .unwrap();
    assert_eq!(header(&g.headers, "x-llm-governor-pool"), "backup");
    assert_eq!(
        host.metrics.count_of(BACKUP, Counter::UpstreamRateLimited),
        1
    );
    // Both cooling: held on the one that frees first (the fallback, 2 s against 5 s), let go a
    // clock's grain after its end.
    assert!(matches!(host.arrive(3, PATH, &[A]), Step::Held));
    host.advance(2_000);
    assert!(host.tick().is_empty());
    host.advance(GRAIN);
    let out = flows(host.tick());
    assert_eq!(out.len(), 1);
    assert_eq!(
        host.governor().pools().steered_to(&out[0].1),
        Some("backup")
    );
    // Hold stats are the home pool's, wherever the request waited or went: the gauge is back
    // at 0 on both pools (the soak found it drifting +n on one and -n on the other).
    assert_eq!(host.metrics.count_of(PRIMARY, Counter::Held), 1);
    assert_eq!(host.metrics.count_of(PRIMARY, Counter::HoldReleased), 1);
    assert_eq!(host.metrics.sum(PRIMARY, Gauge::HeldRequests), 0);
    assert_eq!(host.metrics.sum(BACKUP, Gauge::HeldRequests), 0);
    // Once the primary's own cooldown is over, requests stay home.
    host.advance(3_000);
    let home = go(host.arrive(4, PATH, &[A]));
    assert_eq!(home.pool, PRIMARY);
}

#[test]
fn both_cooling_beyond_the_hold_answers_with_the_shortest_wait() {
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[A]);
    host.respond(&f, 429, &[("retry-after", "30")], RL);
    let steered = go(host.arrive(1, PATH, &[A]));
    host.respond(&steered, 429, &[("retry-after", "20")], RL);
    match host.arrive(2, PATH, &[A]) {
        Step::Reply(r) => {
            assert_eq!(header(&r.headers, "x-llm-governor-source"), "cooldown");
            assert_eq!(
                header(&r.headers, "retry-after-ms"),
                (20_000 + GRAIN).to_string()
            );
        }
        other => panic!("expected a local answer, got {other:?}"),
    }
}

#[test]
fn quota_on_the_primary_steers_for_quota_ms() {
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[A]);
    host.respond(&f, 429, &[], QUOTA);
    for id in 1..=3 {
        let s = go(host.arrive(id, PATH, &[A]));
        assert_eq!(s.pool, BACKUP);
        host.advance(60_000);
    }
    host.advance(120_001); // past quota_ms (300 s)
    assert_eq!(go(host.arrive(9, PATH, &[A])).pool, PRIMARY);
}

#[test]
fn an_upstream_429_with_a_fallback_that_has_room_says_come_back_at_once() {
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[A]);
    let g = host
        .respond(&f, 429, &[("retry-after", "5")], QUOTA)
        .unwrap();
    // Even quota: the retry will be steered, so it is worth making.
    assert_eq!(header(&g.headers, "retry-after-ms"), "5");
    assert_eq!(header(&g.headers, "x-should-retry"), "true");
    assert_eq!(
        header(&g.headers, "x-llm-governor-class"),
        "quota_exhausted"
    );
    // When the fallback is cooling too, the provider's time is told as usual.
    let s = go(host.arrive(1, PATH, &[A]));
    let g = host.respond(&s, 429, &[("retry-after", "7")], RL).unwrap();
    assert_eq!(header(&g.headers, "retry-after-ms"), "7000");
}

#[test]
fn a_full_cap_on_the_primary_steers_before_holding() {
    let mut host = Host::new(
        r#"{"pools": [
          {"name": "primary", "match": {"path_prefix": "/v1/chat"}, "fallback": ["backup"]},
          {"name": "backup", "match": {"header": {"name": "x-never", "value": "x"}}, "account": "k2"}],
          "limits": [{"name": "cap", "key": "account", "max_in_flight": 1}]}"#,
    );
    let first = go(host.arrive(1, PATH, &[A]));
    assert_eq!(first.pool, PRIMARY);
    let second = go(host.arrive(2, PATH, &[A]));
    assert_eq!(
        second.pool, BACKUP,
        "the fallback's account has its own cap"
    );
    assert!(matches!(host.arrive(3, PATH, &[A]), Step::Held));
    host.end(&second);
    let out = flows(host.tick());
    assert_eq!(out.len(), 1);
    host.end(&first);
}

#[test]
fn an_empty_local_bucket_is_never_steered_around() {
    let mut host = Host::new(
        r#"{"hold": {"max_ms": 0}, "pools": [
          {"name": "primary", "match": {"path_prefix": "/v1/chat"}, "fallback": ["backup"]},
          {"name": "backup", "match": {"header": {"name": "x-never", "value": "x"}}}],
          "limits": [{"name": "rpm", "key": "header:x-tenant", "requests_per_minute": 1, "burst": 1}]}"#,
    );
    go(host.arrive(1, PATH, &[A, ("x-tenant", "t")]));
    match host.arrive(2, PATH, &[A, ("x-tenant", "t")]) {
        Step::Reply(r) => assert_eq!(header(&r.headers, "x-llm-governor-source"), "limit"),
        other => panic!("expected a local answer, got {other:?}"),
    }
}

#[test]
fn fallback_configuration_is_validated_naming_the_field() {
    let cases = [
        (
            r#"{"pools": [{"name": "a", "fallback": ["nope"]}]}"#,
            "pools[0].fallback[0]: unknown pool \"nope\"",
        ),
        (
            r#"{"pools": [{"name": "a", "fallback": ["a"]}]}"#,
            "pools[0].fallback[0]: a pool cannot be its own fallback",
        ),
        (
            r#"{"pools": [{"name": "a", "fallback": ["b"]}, {"name": "b", "fallback": ["c"]}, {"name": "c", "fallback": ["a"]}]}"#,
            "pools[0].fallback: cycle",
        ),
        (
            r#"{"pools": [{"name": "a", "fallback": ["b", "b"]}, {"name": "b"}]}"#,
            "pools[0].fallback[1]: \"b\" is listed twice",
        ),
        (
            r#"{"pools": [{"name": "a", "account": " "}]}"#,
            "pools[0].account: must not be empty",
        ),
        (
            r#"{"pools": [{"name": "a", "account": 7}]}"#,
            "pools[0].account: must be a string",
        ),
        (
            r#"{"pools": [{"name": "a", "fallback": "b"}, {"name": "b"}]}"#,
            "pools[0].fallback: must be an array",
        ),
    ];
    for (input, want) in cases {
        match config::parse(input.as_bytes()) {
            Ok(_) => panic!("accepted: {input}"),
            Err(e) => assert!(
                e.to_string().starts_with(want),
                "{input}\n got: {e}\nwant: {want}"
            ),
        }
    }
    let ok = config::parse(CFG.as_bytes()).unwrap();
    assert_eq!(ok.pools[0].fallback, [1]);
    assert_eq!(ok.pools[1].account.as_deref(), Some("backup-key"));
}
