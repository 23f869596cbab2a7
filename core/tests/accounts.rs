//! Which account a request belongs to (README, `account_headers`), and the bound on cooled
//! accounts (`max_keys`).

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::provider::RL;
use common::Decision;
use common::{header, Host};

use llm_governor_core::metrics::Counter;

const CHAT: &str = "/v1/chat/completions";

fn cooled(host: &mut Host, h: &[(&str, &str)]) -> bool {
    match host.request(CHAT, h) {
        Decision::Reply(r) => header(&r.headers, "x-llm-governor-source") == "cooldown",
        Decision::Forward(_) => false,
    }
}

#[test]
fn the_first_present_account_header_wins() {
    let mut host = Host::new(r#"{"hold": {"max_ms": 0}}"#);
    // Default order: x-api-key, authorization, api-key, x-goog-api-key.
    let both = [
        ("authorization", "Bearer sk-second"),
        ("x-api-key", "sk-first"),
    ];
    let flow = host.forward(CHAT, &both);
    assert_eq!(flow.account, host.governor().id(b"sk-first"));
    for (headers, id) in [
        (
            &[("authorization", "Bearer sk-b"), ("api-key", "sk-c")][..],
            "sk-b",
        ),
        (
            &[("x-goog-api-key", "sk-d"), ("api-key", "sk-c")][..],
            "sk-c",
        ),
        (&[("x-goog-api-key", "sk-d")][..], "sk-d"),
        // An empty value is not present: the next header decides.
        (
            &[("x-api-key", ""), ("authorization", "Bearer sk-b")][..],
            "sk-b",
        ),
    ] {
        assert_eq!(
            host.forward(CHAT, headers).account,
            host.governor().id(id.as_bytes()),
            "{headers:?}"
        );
    }
    // Cooling that account cools every request whose first present header is that key...
    host.respond(&flow, 429, &[("retry-after", "5")], RL);
    assert!(cooled(
        &mut host,
        &[
            ("x-api-key", "sk-first"),
            ("authorization", "Bearer sk-other")
        ]
    ));
    assert!(cooled(&mut host, &[("authorization", "Bearer sk-first")]));
    // ...and not one whose first present header is another key.
    assert!(!cooled(&mut host, &[("authorization", "Bearer sk-second")]));
}

#[test]
fn account_headers_are_read_in_the_configured_order() {
    let mut host = Host::new(r#"{"account_headers": ["x-org-key", "authorization"]}"#);
    let h = [
        ("authorization", "Bearer sk-a"),
        ("x-org-key", "org-1"),
        ("x-api-key", "sk-x"),
    ];
    assert_eq!(host.forward(CHAT, &h).account, host.governor().id(b"org-1"));
    // A header that is not configured identifies nothing.
    let none = host.forward(CHAT, &[("x-api-key", "sk-x")]);
    assert_eq!(none.account, host.forward(CHAT, &[]).account);
}

#[test]
fn requests_without_any_account_header_share_one_account() {
    let mut host = Host::new(r#"{"hold": {"max_ms": 0}}"#);
    let anonymous = host.forward(CHAT, &[("x-tenant-id", "t1")]);
    host.respond(&anonymous, 429, &[("retry-after", "5")], RL);
    // Another request with no credential, from anyone, is the same account: cooled.
    assert!(cooled(&mut host, &[("x-tenant-id", "t2")]));
    assert!(cooled(&mut host, &[]));
    // A request with a credential is not.
    assert!(!cooled(&mut host, &[("authorization", "Bearer sk-a")]));
}

#[test]
fn past_max_keys_new_accounts_are_not_cooled_but_told_the_right_time() {
    let mut host = Host::new(r#"{"max_keys": 2, "hold": {"max_ms": 0}}"#);
    host.rng.set(0.5);
    for key in ["sk-1", "sk-2"] {
        let auth = format!("Bearer {key}");
        let f = host.forward(CHAT, &[("authorization", &auth)]);
        host.respond(&f, 429, &[("retry-after", "5")], RL);
        assert!(cooled(&mut host, &[("authorization", &auth)]), "{key}");
    }
    assert_eq!(host.metrics.count_of(0, Counter::OverflowKeys), 0);
    // The third account's 429 still gets its headers, from the provider's time...
    let f = host.forward(CHAT, &[("authorization", "Bearer sk-3")]);
    let g = host
        .respond(&f, 429, &[("retry-after", "5")], RL)
        .unwrap_or_else(|| panic!("not governed"));
    assert_eq!(g.delay_ms, 5_500);
    assert_eq!(header(&g.headers, "retry-after-ms"), "5500");
    assert_eq!(header(&g.headers, "retry-after"), "6");
    assert_eq!(header(&g.headers, "x-llm-governor-class"), "rate_limited");
    assert_eq!(header(&g.headers, "x-llm-governor-source"), "upstream");
    assert_eq!(host.metrics.count_of(0, Counter::UpstreamRateLimited), 3);
    // ...but it is not remembered: its next request goes upstream, and the overflow counts.
    assert_eq!(host.metrics.count_of(0, Counter::OverflowKeys), 1);
    host.forward(CHAT, &[("authorization", "Bearer sk-3")]);
    // The accounts that have a cooldown keep it.
    assert!(cooled(&mut host, &[("authorization", "Bearer sk-1")]));
    // Two cooldown records and the cooldown-key counter, nothing for the third account.
    let keys: Vec<String> = host.store.dump().into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys.len(), 3, "{keys:?}");
}
