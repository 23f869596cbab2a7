//! Holding requests through short waits, driven natively with a fake clock: one worker's
//! hold state machine over the in-memory shared store, exactly as the host drives it.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::provider::{A, B, PATH, QUOTA, RL};
use common::reactions::set_headers;
use common::{answered, cool, flows, go, gone, header, tick_all, Host};
use common::{Sent, Step};
use llm_governor_core::config::Hold;
use llm_governor_core::cooldown::CLOCK_GRAIN_MS as GRAIN;
use llm_governor_core::deadline;
use llm_governor_core::headers::Headers;
use llm_governor_core::metrics::{Counter, Gauge};

const CFG: &str = r#"{"pools": [
  {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}
]}"#;

fn held(step: Step) {
    assert!(matches!(step, Step::Held), "expected held, got {step:?}");
}

fn reply_headers(step: Step) -> Vec<(&'static str, String)> {
    match step {
        Step::Reply(r) => r.headers,
        other => panic!("expected a local answer, got {other:?}"),
    }
}

#[test]
fn a_cooldown_ends_with_one_probe_then_as_many_as_the_provider_has_left() {
    let mut host = Host::new(CFG);
    cool(&mut host, "3");
    for id in 1..=5 {
        held(host.arrive(id, PATH, &[A]));
    }
    assert_eq!(host.metrics.count_of(0, Counter::Held), 5);
    assert_eq!(host.metrics.sum(0, Gauge::HeldRequests), 5);
    host.advance(3_000);
    assert!(
        host.tick().is_empty(),
        "nothing leaves before the provider's time and the clock's grain"
    );
    host.advance(GRAIN);
    let probe = flows(host.tick());
    assert_eq!(probe.len(), 1);
    assert_eq!(probe[0].0, 1, "the first to arrive is the probe");
    assert_eq!(probe[0].1.held_ms, Some(3_000 + GRAIN));
    host.advance(50);
    assert!(
        host.tick().is_empty(),
        "the rest wait for the probe's answer"
    );
    let seen = host.response(
        &probe[0].1,
        200,
        &[("x-ratelimit-remaining-requests", "2")],
        "",
    );
    let told = set_headers(&seen[0]);
    let held_ms = (3_000 + GRAIN).to_string();
    assert_eq!(
        header(&told, "x-llm-governor-held-ms"),
        held_ms,
        "told it was held"
    );
    let next = tick_all(&mut host);
    assert_eq!(
        gone(&next),
        [2, 3],
        "remaining 2: two more, in arrival order, one a tick"
    );
    assert!(host.tick().is_empty());
    assert_eq!(host.metrics.count_of(0, Counter::HoldReleased), 3);
    assert_eq!(host.metrics.sum(0, Gauge::HeldRequests), 2);
}

#[test]
fn without_a_remaining_header_releases_double_with_each_success() {
    let mut host = Host::new(CFG);
    cool(&mut host, "1");
    for id in 1..=10 {
        held(host.arrive(id, PATH, &[A]));
    }
    host.advance(1_000 + GRAIN);
    let mut rounds = Vec::new();
    for _ in 0..4 {
        let out = flows(tick_all(&mut host));
        rounds.push(out.iter().map(|(id, _)| *id).collect::<Vec<_>>());
        for (_, f) in out {
            host.respond(&f, 200, &[], "");
        }
        host.advance(20);
    }
    assert_eq!(
        rounds,
        [vec![1], vec![2, 3], vec![4, 5, 6, 7], vec![8, 9, 10]]
    );
}

#[test]
fn releases_that_trickle_one_at_a_time_open_what_a_freed_window_says_again() {
    // A slow provider (answers take longer than its window takes to free a slot): the probe's
    // answer leaves room for one, and that one's answer, from a window that freed meanwhile,
    // says 8 are left. The pace once kept the round's fewest (1) until a probe that never
    // came: one request on its way at a time, 2 a second at a 500 ms latency instead of 5.
    let mut host = Host::new(CFG);
    let probe = held_through_a_cooldown(&mut host, 12);
    assert_eq!(gone_ids(&probe), [1]);
    host.advance(500);
    host.respond(
        &probe[0].1,
        200,
        &[("x-ratelimit-remaining-requests", "1")],
        "",
    );
    let one = flows(host.tick());
    assert_eq!(gone_ids(&one), [2], "room for one");
    host.advance(500);
    host.respond(
        &one[0].1,
        200,
        &[("x-ratelimit-remaining-requests", "8")],
        "",
    );
    assert_eq!(
        gone(&tick_all(&mut host)),
        [3, 4, 5, 6, 7, 8, 9, 10],
        "the window freed: eight"
    );
}

#[test]
fn a_slow_answers_reset_counts_from_the_release_when_it_is_a_duration() {
    // The probe goes 1,001 ms after T0 and is answered 400 ms later with nothing left. OpenAI
    // states the reset as a duration from when it took the request: the window reopens at
    // the release + 1,599 ms (plus the 20 ms the request may have been on its way,
    // TRANSIT_MS), not 1,599 ms after the slow answer. Anthropic states an instant. An answer
    // quicker than the way there counts from the answer.
    const DURATION: &[(&str, &str)] = &[
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "1599ms"),
    ];
    type Row<'a> = (&'a str, &'a [(&'a str, &'a str)], u64, u64);
    let rows: [Row; 3] = [
        ("duration", DURATION, 400, 1_001 + 20 + 1_599),
        ("quick duration", DURATION, 5, 1_001 + 5 + 1_599),
        (
            "instant",
            &[
                ("anthropic-ratelimit-requests-remaining", "0"),
                ("anthropic-ratelimit-requests-reset", "2026-11-30T16:20:03Z"),
            ],
            400,
            3_000,
        ),
    ];
    for (what, headers, latency_ms, opens_at) in rows {
        let mut host = Host::new(CFG);
        let probe = held_through_a_cooldown(&mut host, 3);
        assert_eq!(gone_ids(&probe), [1], "{what}");
        host.advance(latency_ms);
        host.respond(&probe[0].1, 200, headers, "");
        host.now_ms = common::T0 + opens_at;
        assert!(
            host.tick().is_empty(),
            "{what}: not before the window reopens"
        );
        host.advance(GRAIN);
        assert_eq!(gone(&host.tick()), [2], "{what}: the next probe, on time");
    }
}

fn gone_ids(flows: &[(u32, impl Sized)]) -> Vec<u32> {
    flows.iter().map(|(id, _)| *id).collect()
}

/// Account A cools for 1 s with requests 1 to `n` held; the cooldown ends: what the tick
/// lets go (the probe).
fn held_through_a_cooldown(host: &mut Host, n: u32) -> Vec<(u32, Sent)> {
    cool(host, "1");
    for id in 1..=n {
        held(host.arrive(id, PATH, &[A]));
    }
    host.advance(1_000 + GRAIN);
    flows(host.tick())
}

#[test]
fn a_429_on_the_probe_cools_again_and_the_rest_stay_held() {
    let mut host = Host::new(CFG);
    let probe = held_through_a_cooldown(&mut host, 3);
    assert_eq!(probe.len(), 1);
    host.respond(&probe[0].1, 429, &[("retry-after", "2")], RL);
    host.advance(2_000);
    assert!(host.tick().is_empty());
    host.advance(GRAIN);
    assert_eq!(
        gone(&host.tick()),
        [2],
        "one probe again after the new cooldown"
    );
}

#[test]
fn an_unanswered_probe_lets_one_more_go_after_the_patience() {
    let mut host = Host::new(CFG);
    assert_eq!(gone_ids(&held_through_a_cooldown(&mut host, 3)), [1]);
    host.advance(999);
    assert!(host.tick().is_empty());
    host.advance(1);
    assert_eq!(
        gone(&host.tick()),
        [2],
        "a probe still generating was accepted"
    );
}

#[test]
fn a_new_request_never_overtakes_held_ones() {
    let mut host = Host::new(CFG);
    cool(&mut host, "1");
    held(host.arrive(1, PATH, &[A]));
    host.advance(1_000 + GRAIN);
    // The cooldown is over, but request 1 has not been let go yet: 2 queues behind it.
    held(host.arrive(2, PATH, &[A]));
    assert_eq!(gone(&host.tick()), [1]);
    // Another account is not held behind account A.
    go(host.arrive(3, PATH, &[B]));
}

#[test]
fn the_clients_deadline_bounds_the_hold() {
    let mut host = Host::new(CFG);
    cool(&mut host, "5");
    // A 3 s client meeting a 5 s cooldown: 3 s - 2 s margin = 1 s < 5 s, answered at once.
    let h = reply_headers(host.arrive(1, PATH, &[A, ("x-stainless-read-timeout", "3")]));
    assert_eq!(header(&h, "x-llm-governor-source"), "cooldown");
    assert!(!h.iter().any(|(n, _)| *n == "x-llm-governor-held-ms"));
    // A 60 s client is held (10 s max) and goes when the cooldown ends.
    held(host.arrive(2, PATH, &[A, ("x-stainless-read-timeout", "60")]));
    host.advance(5_000 + GRAIN);
    let out = flows(host.tick());
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].1.held_ms, Some(5_000 + GRAIN));
}

#[test]
fn quota_exhaustion_is_never_held() {
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[A]);
    host.respond(&f, 429, &[], QUOTA);
    let h = reply_headers(host.arrive(1, PATH, &[A]));
    assert_eq!(header(&h, "x-should-retry"), "false");
    assert_eq!(header(&h, "x-llm-governor-class"), "quota_exhausted");
    assert_eq!(host.metrics.count_of(0, Counter::Held), 0);
}

#[test]
fn past_max_held_requests_are_answered_at_once() {
    let mut host = Host::new(
        r#"{"hold": {"max_held": 2}, "pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}}]}"#,
    );
    cool(&mut host, "2");
    held(host.arrive(1, PATH, &[A]));
    held(host.arrive(2, PATH, &[A]));
    let h = reply_headers(host.arrive(3, PATH, &[A]));
    assert_eq!(header(&h, "x-llm-governor-source"), "cooldown");
    assert_eq!(host.worker.held(), 2);
}

#[test]
fn hold_off_answers_every_wait_at_once_and_lets_everything_go_after_a_cooldown() {
    let mut host = Host::new(
        r#"{"hold": {"max_ms": 0}, "pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}}]}"#,
    );
    cool(&mut host, "2");
    let h = reply_headers(host.arrive(1, PATH, &[A]));
    assert_eq!(header(&h, "x-llm-governor-source"), "cooldown");
    host.advance(2_000 + GRAIN);
    for id in 2..=4 {
        go(host.arrive(id, PATH, &[A]));
    }
}

#[test]
fn a_wait_that_outgrows_its_limit_is_answered_with_the_time_left() {
    let mut host = Host::new(CFG);
    // A request of account A that went before the cooldown, still in flight.
    let in_flight = host.forward(PATH, &[A]);
    cool(&mut host, "3");
    let racing = host.forward(PATH, &[B]); // another account, unaffected
    held(host.arrive(1, PATH, &[A]));
    // The request in flight meets a 20 s "not now" for account A.
    host.advance(100);
    host.respond(&in_flight, 429, &[("retry-after", "20")], RL);
    host.advance(2_900 + GRAIN);
    let out = host.tick();
    assert_eq!(answered(&out), [1]);
    let (_, Step::Reply(reply)) = &out[0] else {
        panic!("expected a local answer");
    };
    assert_eq!(
        header(&reply.headers, "x-llm-governor-held-ms"),
        (3000 + GRAIN).to_string()
    );
    // 20 s from 100 ms in, answered at 3 s (both cooldowns a grain longer): 17.1 s left, plus
    // jitter of the 20 s period.
    let ms: u64 = header(&reply.headers, "retry-after-ms")
        .parse()
        .unwrap_or(0);
    assert_eq!(ms, 17_100, "rng fixed at 0: exactly the time left");
    assert_eq!(host.metrics.count_of(0, Counter::HoldExpired), 1);
    assert_eq!(host.metrics.sum(0, Gauge::HeldRequests), 0);
    host.end(&racing);
}

#[test]
fn a_client_that_leaves_while_held_is_forgotten() {
    let mut host = Host::new(CFG);
    cool(&mut host, "1");
    held(host.arrive(1, PATH, &[A]));
    held(host.arrive(2, PATH, &[A]));
    host.end(1);
    assert_eq!(host.worker.held(), 1);
    host.end(1);
    assert_eq!(host.worker.held(), 1, "forgotten once");
    assert_eq!(host.metrics.sum(0, Gauge::HeldRequests), 1);
    host.advance(1_000 + GRAIN);
    assert_eq!(gone(&host.tick()), [2], "the one who stayed is the probe");
}

const CAP: &str = r#"{"pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}}],
  "limits": [{"name": "cap", "key": "account", "max_in_flight": 2}]}"#;

#[test]
fn max_in_flight_holds_the_next_until_a_stream_ends() {
    let mut host = Host::new(CAP);
    let f1 = go(host.arrive(1, PATH, &[A]));
    let f2 = go(host.arrive(2, PATH, &[A]));
    held(host.arrive(3, PATH, &[A]));
    go(host.arrive(4, PATH, &[B]));
    assert_eq!(host.metrics.sum(0, Gauge::InFlight), 3);
    host.advance(20);
    assert!(host.tick().is_empty());
    // However the stream ends (a reset here: no answer at all), its slot comes back.
    host.end(&f1);
    host.end(&f1);
    let f3 = flows(host.tick());
    assert_eq!(f3.len(), 1);
    assert_eq!(f3[0].0, 3);
    host.respond(&f2, 200, &[], "");
    host.end(&f2);
    host.end(&f3[0].1);
    assert_eq!(
        host.metrics.sum(0, Gauge::InFlight),
        1,
        "only account B's is left"
    );
}

#[test]
fn a_full_cap_holds_a_newcomer_however_slowly_the_queue_drained_lately() {
    // A full cap frees when some stream ends, which nothing foretells: the pace its releases
    // came at lately says what a request would be told, never that its turn cannot come within
    // its hold. (Shed on that estimate, an SDK client with 60 s to wait got a local 429 in the
    // e2e cap test while the provider answered every request.)
    let mut host =
        Host::new(r#"{"limits": [{"name": "cap", "key": "account", "max_in_flight": 1}]}"#);
    let sdk = [A, ("x-stainless-read-timeout", "60")];
    let mut upstream = go(host.arrive(1, PATH, &sdk));
    for id in 2..=20 {
        held(host.arrive(id, PATH, &sdk));
    }
    // Streams of a second each: one release a second, 16 held when the next one comes.
    for next in 2..=4 {
        host.advance(1_000);
        host.respond(&upstream, 200, &[], "");
        host.end(&upstream);
        let out = flows(host.tick());
        assert_eq!(gone_ids(&out), [next]);
        upstream = out.into_iter().next().map(|(_, sent)| sent).unwrap();
    }
    held(host.arrive(21, PATH, &sdk));
    assert_eq!(host.metrics.count_of(0, Counter::LocalRejectLimit), 0);
}

#[test]
fn a_full_cap_answered_locally_says_limit() {
    let mut host = Host::new(
        r#"{"hold": {"max_ms": 0}, "limits": [{"name": "cap", "key": "account", "max_in_flight": 1}]}"#,
    );
    go(host.arrive(1, PATH, &[A]));
    let Step::Reply(r) = host.arrive(2, PATH, &[A]) else {
        panic!("a local answer");
    };
    assert_eq!(header(&r.headers, "x-llm-governor-source"), "limit");
    assert_eq!(header(&r.headers, "retry-after-ms"), "1000");
    // The body says what is full: not the provider, which said nothing.
    let body = String::from_utf8(r.body).unwrap();
    assert!(body.contains("max_in_flight limit is full"), "{body}");
    assert_eq!(host.metrics.count_of(0, Counter::LocalRejectLimit), 1);
}

#[test]
fn a_request_refused_by_a_later_limit_gives_back_what_earlier_ones_gave() {
    let mut host = Host::new(
        r#"{"limits": [
          {"name": "rpm", "key": "account", "requests_per_minute": 600, "burst": 2},
          {"name": "cap", "key": "account", "max_in_flight": 1}]}"#,
    );
    let f1 = go(host.arrive(1, PATH, &[A]));
    held(host.arrive(2, PATH, &[A]));
    // Frozen clock: no refill. Each tick asks both limits again; without the give-back the
    // bucket's last token would be gone after the first tick.
    for _ in 0..5 {
        assert!(host.tick().is_empty());
    }
    host.end(&f1);
    assert_eq!(gone(&host.tick()), [2], "the bucket still had its token");
    match host.arrive(3, PATH, &[A]) {
        Step::Held => {}
        other => panic!("the bucket is empty now: expected held, got {other:?}"),
    }
}

#[test]
fn an_empty_bucket_holds_until_it_refills() {
    let mut host = Host::new(
        r#"{"limits": [{"name": "rpm", "key": "account", "requests_per_minute": 60, "burst": 1}]}"#,
    );
    go(host.arrive(1, PATH, &[A]));
    held(host.arrive(2, PATH, &[A]));
    host.advance(999);
    assert!(host.tick().is_empty());
    host.advance(1);
    let out = flows(host.tick());
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].1.held_ms, Some(1_000));
}

/// Raw header pairs (values may be any bytes).
type RawHeaders<'a> = &'a [(&'a str, &'a [u8])];

fn budget(cfg: &Hold, headers: RawHeaders) -> u64 {
    let hs: Vec<(String, Vec<u8>)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_vec()))
        .collect();
    deadline::hold_budget_ms(cfg, 0, &Headers::new(&hs))
}

#[test]
fn deadline_headers_are_read_safely() {
    let cfg = llm_governor_core::config::Config::default().hold;
    let rows: &[(RawHeaders, u64)] = &[
        (&[], 10_000),
        (&[("x-stainless-read-timeout", b"600")], 10_000),
        (&[("x-stainless-read-timeout", b"5")], 3_000),
        (&[("x-stainless-read-timeout", b"5.5")], 3_500),
        (&[("x-stainless-read-timeout", b"2")], 0),
        (&[("x-stainless-read-timeout", b"1")], 0),
        (&[("x-stainless-timeout", b"4")], 2_000),
        (&[("x-envoy-expected-rq-timeout-ms", b"4500")], 2_500),
        // The first present header wins.
        (
            &[
                ("x-stainless-timeout", b"4"),
                ("x-stainless-read-timeout", b"6"),
            ],
            4_000,
        ),
        // Malformed values are ignored: the next header, or the plain maximum.
        (&[("x-stainless-read-timeout", b"-5")], 10_000),
        (&[("x-stainless-read-timeout", b"NaN")], 10_000),
        (&[("x-stainless-read-timeout", b"inf")], 10_000),
        (&[("x-stainless-read-timeout", b"1e3")], 10_000),
        (&[("x-stainless-read-timeout", b"\xff\xfe")], 10_000),
        (
            &[
                ("x-stainless-read-timeout", b"abc"),
                ("x-stainless-timeout", b"3"),
            ],
            1_000,
        ),
        // Huge is still bounded by hold.max_ms.
        (
            &[("x-stainless-read-timeout", b"99999999999999999999999")],
            10_000,
        ),
        // Duplicated: the shortest counts.
        (
            &[
                ("x-stainless-read-timeout", b"60"),
                ("x-stainless-read-timeout", b"4"),
            ],
            2_000,
        ),
    ];
    for (headers, want) in rows {
        assert_eq!(budget(&cfg, headers), *want, "{headers:?}");
    }
    let off = Hold {
        max_ms: 0,
        ..cfg.clone()
    };
    assert_eq!(budget(&off, &[]), 0);
}

#[test]
fn after_a_429_that_reported_requests_left_releases_double_instead_of_trusting_remaining() {
    // A concurrency limit's 429 still says 59 requests left: that number is not what the
    // provider can take at once, so the pace doubles (the overnight storm released everyone).
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[A]);
    host.respond(
        &f,
        429,
        &[
            ("retry-after", "1"),
            ("x-ratelimit-remaining-requests", "59"),
        ],
        RL,
    );
    for id in 1..=8 {
        held(host.arrive(id, PATH, &[A]));
    }
    host.advance(1_000 + GRAIN);
    let probe = flows(host.tick());
    assert_eq!(probe.len(), 1);
    host.respond(
        &probe[0].1,
        200,
        &[("x-ratelimit-remaining-requests", "59")],
        "",
    );
    assert_eq!(gone(&tick_all(&mut host)), [2, 3], "two, not all seven");
}

#[test]
fn held_requests_wait_for_the_end_of_a_burst_of_429s_that_all_said_the_same_time() {
    // A burst of "3 s" answers over 100 ms: clients are told 3 s (plus jitter) from the first,
    // but a window that counts rejected requests reopens 3 s after the last: held requests go
    // then (the failover storm's probe met a full window 3 s after the first 429).
    let mut host = Host::new(CFG);
    let first = host.forward(PATH, &[A]);
    let second = host.forward(PATH, &[A]);
    host.respond(&first, 429, &[("retry-after", "3")], RL);
    host.advance(100);
    host.respond(&second, 429, &[("retry-after", "3")], RL);
    held(host.arrive(1, PATH, &[A]));
    host.advance(2_900 + GRAIN); // 3 s after the first 429
    assert!(host.tick().is_empty(), "not before the burst's last 3 s");
    host.advance(100);
    assert_eq!(gone(&host.tick()), [1]);
}

#[test]
fn without_holding_the_first_deadline_of_a_burst_lets_clients_through() {
    let mut host = Host::new(
        r#"{"hold": {"max_ms": 0}, "pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}}]}"#,
    );
    let first = host.forward(PATH, &[A]);
    let second = host.forward(PATH, &[A]);
    host.respond(&first, 429, &[("retry-after", "3")], RL);
    host.advance(100);
    host.respond(&second, 429, &[("retry-after", "3")], RL);
    host.advance(2_900 + GRAIN);
    go(host.arrive(1, PATH, &[A]));
}

#[test]
fn a_request_whose_turn_cannot_come_in_time_is_told_its_turn_at_once_one_after_another() {
    // One request a second (burst 1): the queue drains a request a second, so a request that
    // cannot wait for its turn is answered at once with it (the head's wait plus one second
    // for each ahead of it), and those answered after it one second later each (they come
    // back one after another, not all at once to queue again).
    let mut host = Host::new(
        r#"{"limits": [{"name": "rps", "key": "pool", "requests_per_minute": 60, "burst": 1}]}"#,
    );
    go(host.arrive(1, PATH, &[A]));
    let deadline = [A, ("x-envoy-expected-rq-timeout-ms", "3500")]; // 1.5 s to hold
    held(host.arrive(2, PATH, &deadline));
    let told: Vec<String> = (3..=6)
        .map(|id| {
            let h = reply_headers(host.arrive(id, PATH, &deadline));
            header(&h, "retry-after-ms").to_string()
        })
        .collect();
    assert_eq!(
        told,
        ["2000", "3000", "4000", "5000"],
        "behind 2, due in 1 s"
    );
    host.advance(1_000);
    assert_eq!(
        gone(&host.tick()),
        [2],
        "the head goes when its token has refilled"
    );
    // A held request whose turn slipped past its limit (the worker ticked late, say) is
    // answered at its deadline with its turn: one ahead of it, then its own.
    held(host.arrive(7, PATH, &[A]));
    held(host.arrive(8, PATH, &[A]));
    held(host.arrive(9, PATH, &[A]));
    held(host.arrive(10, PATH, &[A, ("x-envoy-expected-rq-timeout-ms", "6000")]));
    host.advance(3_000);
    assert_eq!(gone(&host.tick()), [7], "late: one token, not three");
    host.advance(1_000);
    let out = host.tick();
    assert_eq!(gone(&out), [8]);
    assert_eq!(
        answered(&out),
        [10],
        "its 4 s are up; 9 is still ahead of it"
    );
    let Step::Reply(r) = &out[1].1 else {
        panic!("a local answer");
    };
    assert_eq!(
        header(&r.headers, "retry-after-ms"),
        "2000",
        "9 in 1 s, then 10"
    );
}

#[test]
fn after_a_cooldown_the_pace_reads_anthropics_remaining_requests_too() {
    let mut host = Host::new(
        r#"{"pools": [{"name": "claude", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"}]}"#,
    );
    let path = "/v1/messages";
    let key = ("x-api-key", "sk-ant-a");
    let f = host.forward(path, &[key]);
    let rl = r#"{"type":"error","error":{"type":"rate_limit_error","message":"x"}}"#;
    host.respond(&f, 429, &[("retry-after", "2")], rl);
    for id in 1..=6 {
        held(host.arrive(id, path, &[key]));
    }
    host.advance(2_000 + GRAIN);
    let probe = flows(host.tick());
    assert_eq!(probe.len(), 1, "one probe");
    host.respond(
        &probe[0].1,
        200,
        &[("anthropic-ratelimit-requests-remaining", "3")],
        "",
    );
    assert_eq!(
        gone(&tick_all(&mut host)),
        [2, 3, 4],
        "Anthropic's remaining 3: three more"
    );
    assert!(host.tick().is_empty());
}

#[test]
fn after_a_cooldown_the_pace_releases_what_the_remaining_tokens_hold_for_a_request_this_size() {
    // A reserving token limit knows each request's size: a probe that comes back with room
    // for 100 more requests but tokens for two of its size releases two, not a hundred.
    let mut host = Host::new(
        r#"{"pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}],
            "limits": [{"name": "tpm", "key": "pool", "tokens_per_minute": 1000000, "reserve": true}]}"#,
    );
    let body =
        br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}],"max_tokens":1000}"#;
    let f = host.forward_with_body(PATH, &[A], body);
    let need = f.charges[0].reserved;
    assert!((1000..1100).contains(&need), "{need}");
    host.respond(&f, 429, &[("retry-after", "2")], RL);
    for id in 1..=6 {
        held(host.arrive_with_body(id, PATH, &[A], body));
    }
    host.advance(2_000 + GRAIN);
    let probe = flows(host.tick());
    assert_eq!(probe.len(), 1, "one probe");
    let tokens_left = (2 * need + need / 2).to_string();
    host.respond(
        &probe[0].1,
        200,
        &[
            ("x-ratelimit-remaining-requests", "100"),
            ("x-ratelimit-remaining-tokens", &tokens_left),
        ],
        "",
    );
    assert_eq!(
        gone(&tick_all(&mut host)),
        [2, 3],
        "tokens for two more of this size"
    );
    assert!(host.tick().is_empty());
}
