//! The retry signals the official SDKs send: `x-stainless-retry-count` on every attempt.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::provider::{A, PATH};
use common::Host;
use common::Step;
use llm_governor_core::metrics::Counter;

fn attempt(host: &mut Host, count: &str, status: u16) {
    match host.arrive(1, PATH, &[A, ("x-stainless-retry-count", count)]) {
        Step::Go(sent) => {
            host.respond(&sent, status, &[("retry-after", "1")], "");
            host.end(&sent);
        }
        other => panic!("expected to go, got {other:?}"),
    }
    host.advance(2_000);
}

#[test]
fn retries_and_successes_after_a_retry_are_counted() {
    let mut host = Host::new("{}");
    attempt(&mut host, "0", 200); // a first attempt: neither
    attempt(&mut host, "1", 429); // a retry that failed again
    attempt(&mut host, "2", 200); // a retry that succeeded
    assert_eq!(host.metrics.count_of(0, Counter::ClientRetries), 2);
    assert_eq!(host.metrics.count_of(0, Counter::SucceededAfterRetry), 1);
}

#[test]
fn malformed_retry_counts_are_not_retries() {
    let mut host = Host::new("{}");
    for bad in ["-1", "x", "", "1.5", "99999999999"] {
        attempt(&mut host, bad, 200);
    }
    assert_eq!(host.metrics.count_of(0, Counter::ClientRetries), 0);
    assert_eq!(host.metrics.count_of(0, Counter::SucceededAfterRetry), 0);
}
