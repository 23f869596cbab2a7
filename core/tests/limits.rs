//! Local request budgets and the bound on shared-data keys.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::Decision;
use common::{header, Host};
use llm_governor_core::metrics::Counter;

const CFG: &str = r#"{"limits": [
  {"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 60, "burst": 5}
]}"#;

fn admitted(host: &mut Host, tenant: Option<&str>) -> bool {
    let h: Vec<(&str, &str)> = tenant.map(|t| vec![("x-tenant-id", t)]).unwrap_or_default();
    matches!(
        host.request("/v1/chat/completions", &h),
        Decision::Forward(_)
    )
}

#[test]
fn burst_then_one_per_second_with_ietf_fields() {
    let mut host = Host::new(CFG);
    for _ in 0..5 {
        assert!(admitted(&mut host, Some("t1")));
    }
    match host.request("/v1/chat/completions", &[("x-tenant-id", "t1")]) {
        Decision::Reply(r) => {
            assert_eq!(header(&r.headers, "x-llm-governor-source"), "limit");
            assert_eq!(header(&r.headers, "retry-after-ms"), "1000");
            assert_eq!(header(&r.headers, "retry-after"), "1");
            assert_eq!(
                header(&r.headers, "ratelimit-policy"),
                "\"tenant-rpm\";q=60;w=60"
            );
            assert_eq!(header(&r.headers, "ratelimit"), "\"tenant-rpm\";r=0;t=1");
        }
        Decision::Forward(_) => panic!("sixth request admitted"),
    }
    assert_eq!(
        host.metrics.count_of(3, Counter::LocalRejectLimit)
            + host.metrics.count_of(0, Counter::LocalRejectLimit),
        1
    );
    // Other tenants have their own bucket.
    assert!(admitted(&mut host, Some("t2")));
    host.advance(1000);
    assert!(admitted(&mut host, Some("t1")));
    assert!(!admitted(&mut host, Some("t1")));
}

#[test]
fn requests_without_the_header_share_one_bucket() {
    let mut host = Host::new(CFG);
    for _ in 0..5 {
        assert!(admitted(&mut host, None));
    }
    assert!(!admitted(&mut host, None));
    assert!(!admitted(&mut host, Some("-")));
}

#[test]
fn account_and_pool_keys() {
    let mut host = Host::new(
        r#"{"limits": [
        {"name": "per-account", "key": "account", "requests_per_minute": 600, "burst": 2},
        {"name": "per-pool", "key": "pool", "requests_per_minute": 600, "burst": 3}
    ]}"#,
    );
    let a = [("authorization", "Bearer a")];
    let b = [("authorization", "Bearer b")];
    assert!(matches!(host.request("/x", &a), Decision::Forward(_)));
    assert!(matches!(host.request("/x", &a), Decision::Forward(_)));
    assert!(matches!(host.request("/x", &a), Decision::Reply(..)));
    assert!(matches!(host.request("/x", &b), Decision::Forward(_)));
    // The pool bucket (3) is now empty for everyone.
    assert!(matches!(host.request("/x", &b), Decision::Reply(..)));
}

#[test]
fn requests_are_not_taken_from_token_budgets() {
    let mut host =
        Host::new(r#"{"limits": [{"name": "tpm", "key": "pool", "tokens_per_minute": 1}]}"#);
    for _ in 0..10 {
        assert!(admitted(&mut host, None));
    }
}

#[test]
fn keys_past_max_keys_share_an_overflow_bucket() {
    let mut host = Host::new(
        r#"{"max_keys": 10, "limits": [
        {"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 60, "burst": 3}
    ]}"#,
    );
    for i in 0..10_000 {
        host.advance(1);
        admitted(&mut host, Some(&format!("tenant-{i}")));
    }
    // 10 bucket keys, the overflow bucket and the bucket-key counter.
    assert_eq!(
        host.store.len(),
        12,
        "{:?}",
        host.store
            .dump()
            .iter()
            .map(|(k, _)| k.clone())
            .collect::<Vec<_>>()
    );
    // Every tenant after the first ten: one overflow each, counted once.
    assert_eq!(host.metrics.count_of(0, Counter::OverflowKeys), 9_990);
    // The overflow bucket is shared: new tenants are limited together.
    let mut host2 = Host::new(
        r#"{"max_keys": 1, "limits": [
        {"name": "r", "key": "header:x-tenant-id", "requests_per_minute": 60, "burst": 2}
    ]}"#,
    );
    assert!(admitted(&mut host2, Some("first")));
    assert!(admitted(&mut host2, Some("new-1")));
    assert!(admitted(&mut host2, Some("new-2")));
    assert!(!admitted(&mut host2, Some("new-3")));
    assert!(admitted(&mut host2, Some("first")));
}

#[test]
fn contention_fails_open_and_is_counted() {
    let mut host = Host::new(
        r#"{"limits": [{"name": "r", "key": "pool", "requests_per_minute": 60, "burst": 1}]}"#,
    );
    assert!(admitted(&mut host, None));
    assert!(!admitted(&mut host, None));
    // A token has refilled, so the take must write; every write now meets a conflict.
    host.advance(1_000);
    host.store
        .inject_conflicts
        .store(1_000, std::sync::atomic::Ordering::SeqCst);
    assert!(admitted(&mut host, None), "a give-up admits");
    assert_eq!(host.metrics.count_of(0, Counter::StoreContention), 1);
}

#[test]
fn tenant_floods_cannot_switch_off_cooldowns() {
    let mut host = Host::new(
        r#"{"max_keys": 20, "limits": [
        {"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 60, "burst": 3}
    ]}"#,
    );
    for i in 0..100 {
        admitted(&mut host, Some(&format!("tenant-{i}")));
    }
    let a = [
        ("authorization", "Bearer sk-new"),
        ("x-tenant-id", "tenant-0"),
    ];
    let flow = match host.request("/v1/chat/completions", &a) {
        Decision::Forward(f) => f,
        Decision::Reply(..) => panic!("not admitted"),
    };
    host.respond(&flow, 429, &[("retry-after", "4")], "{}");
    match host.request("/v1/chat/completions", &a) {
        Decision::Reply(r) => {
            assert_eq!(header(&r.headers, "x-llm-governor-source"), "cooldown")
        }
        Decision::Forward(_) => panic!("the cooldown was not recorded"),
    }
}

/// Three limits (past the two a flow keeps inline): each is taken with its own key, and a
/// refusal names the limit that refused.
#[test]
fn three_limits_each_keyed_its_own_way() {
    let mut host = Host::new(
        r#"{"limits": [
          {"name": "tenant", "key": "header:x-tenant-id", "requests_per_minute": 60, "burst": 2},
          {"name": "account", "key": "account", "requests_per_minute": 60, "burst": 3},
          {"name": "team", "key": "header:x-team", "requests_per_minute": 60, "burst": 100}
        ]}"#,
    );
    let ask = |host: &mut Host, tenant: &str| {
        host.request(
            "/v1/chat/completions",
            &[
                ("x-tenant-id", tenant),
                ("x-team", "a"),
                ("authorization", "Bearer k"),
            ],
        )
    };
    let team_a = host.governor().id(b"a");
    let refused_by = |d: Decision| match d {
        Decision::Reply(r) => header(&r.headers, "ratelimit-policy").to_string(),
        Decision::Forward(f) => {
            assert_eq!(f.limit_keys.len(), 3);
            assert_eq!(f.limit_keys[2], team_a);
            String::new()
        }
    };
    assert_eq!(refused_by(ask(&mut host, "t1")), "");
    assert_eq!(refused_by(ask(&mut host, "t1")), "");
    assert_eq!(refused_by(ask(&mut host, "t1")), "\"tenant\";q=60;w=60");
    // Another tenant of the same account: its own tenant bucket, the account's third token.
    assert_eq!(refused_by(ask(&mut host, "t2")), "");
    assert_eq!(refused_by(ask(&mut host, "t2")), "\"account\";q=60;w=60");
}
