//! Ids of client-chosen values are keyed (issue 20): two tenant ids (or credentials) that
//! collide under the unkeyed FNV-1a the filter used before land in different buckets, so a
//! client that can choose its tenant id cannot compute one that drains another tenant's budget.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{Decision, Host};
use llm_governor_core::keys::{fnv1a64, HashKey};

/// Two 16-hex-digit strings with the same FNV-1a 64 (found by `find_an_fnv_collision` below:
/// Pollard's rho with Brent's cycle finding over x -> fnv1a64(hex16(x)), from x = 7).
const A: &str = "cf3b407479f245ff";
const B: &str = "6109ebe5d392eff8";

#[test]
fn the_pair_collides_under_fnv() {
    assert_ne!(A, B);
    assert_eq!(fnv1a64(A.as_bytes()), fnv1a64(B.as_bytes()));
    assert_eq!(fnv1a64(A.as_bytes()), 0xe9bd_dae0_5bd9_6785);
}

#[test]
fn colliding_tenant_ids_land_in_different_buckets() {
    let mut host = Host::new(
        r#"{"hold": {"max_ms": 0}, "limits": [{"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 1, "burst": 1}]}"#,
    );
    let path = "/v1/chat/completions";
    assert!(matches!(
        host.request(path, &[("x-tenant-id", A)]),
        Decision::Forward(_)
    ));
    assert!(
        matches!(
            host.request(path, &[("x-tenant-id", A)]),
            Decision::Reply(_)
        ),
        "A's bucket is empty"
    );
    assert!(
        matches!(
            host.request(path, &[("x-tenant-id", B)]),
            Decision::Forward(_)
        ),
        "B has a bucket of its own"
    );
}

#[test]
fn colliding_credentials_are_different_accounts() {
    let mut host = Host::new("{}");
    let path = "/v1/chat/completions";
    let a = host.forward(path, &[("authorization", &format!("Bearer {A}"))]);
    let b = host.forward(path, &[("authorization", &format!("Bearer {B}"))]);
    assert_ne!(a.account, b.account);
    // A's cooldown does not reach B.
    host.respond(&a, 429, &[("retry-after", "30")], "");
    assert!(matches!(
        host.request(path, &[("authorization", &format!("Bearer {A}"))]),
        Decision::Reply(_)
    ));
    assert!(matches!(
        host.request(path, &[("authorization", &format!("Bearer {B}"))]),
        Decision::Forward(_)
    ));
}

#[test]
fn ids_depend_on_the_key() {
    let one = HashKey::from_words(1, 2);
    let other = HashKey::from_words(3, 4);
    assert_ne!(one.id(A.as_bytes()), other.id(A.as_bytes()));
    assert_ne!(one.id(A.as_bytes()), one.id(B.as_bytes()));
    // The same secret gives the same key: every Envoy of a fleet agrees.
    let secret = b"a fleet-wide secret of some length";
    assert_eq!(HashKey::from_secret(secret), HashKey::from_secret(secret));
}

/// How the pair above was found (about 10^10 hashes: minutes on one core).
#[test]
#[ignore = "minutes of work; run with --ignored to find the pair again"]
fn find_an_fnv_collision() {
    let hex = |x: u64| format!("{x:016x}");
    let f = |x: u64| fnv1a64(hex(x).as_bytes());
    let (mut power, mut lam, mut tortoise) = (1u64, 1u64, 7u64);
    let mut hare = f(7);
    while tortoise != hare {
        if power == lam {
            tortoise = hare;
            power *= 2;
            lam = 0;
        }
        hare = f(hare);
        lam += 1;
    }
    let (mut t, mut h) = (7u64, (0..lam).fold(7u64, |x, _| f(x)));
    let (mut pt, mut ph) = (t, h);
    while t != h {
        (pt, ph) = (t, h);
        (t, h) = (f(t), f(h));
    }
    assert_ne!(pt, ph, "the start was on the cycle: try another");
    assert_eq!((hex(pt), hex(ph)), (A.to_string(), B.to_string()));
}
