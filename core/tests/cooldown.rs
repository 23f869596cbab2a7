//! Shared cooldowns per (pool, account): answered locally while the provider says "not now".

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::provider::{A, B, PATH, QUOTA, RL};
use common::Decision;
use common::{header, Host, Sent};
use llm_governor_core::cooldown::CLOCK_GRAIN_MS as GRAIN;
use llm_governor_core::metrics::Counter;

const CFG: &str = r#"{"pools": [
  {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
  {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"}
]}"#;
/// CFG without holding: after a cooldown, everything goes at once (no pace: nothing could wait
/// for a release).
const CFG_NO_HOLD: &str = r#"{"hold": {"max_ms": 0}, "pools": [
  {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}
]}"#;

fn local(host: &mut Host, path: &str, h: &[(&str, &str)]) -> Vec<(&'static str, String)> {
    match host.request(path, h) {
        Decision::Reply(r) => {
            assert_eq!(r.status, 429);
            r.headers
        }
        Decision::Forward(_) => panic!("expected a local answer"),
    }
}

#[test]
fn rate_limit_cools_the_account_until_the_provider_time() {
    let mut host = Host::new(CFG);
    host.rng.set(0.5);
    let flow = host.forward(PATH, &[A]);
    host.respond(&flow, 429, &[("retry-after", "4")], RL);
    for i in 1..=100 {
        host.advance(39);
        let h = local(&mut host, PATH, &[A]);
        assert_eq!(header(&h, "x-llm-governor-source"), "cooldown");
        assert_eq!(header(&h, "x-should-retry"), "true");
        // What is left of the 4 s (and the clock's grain), plus half (the fixed random value)
        // of 20 % of the 4 s.
        let left = 4000 + GRAIN - 39 * i;
        assert_eq!(
            header(&h, "retry-after-ms"),
            (left + 400).to_string(),
            "{i}"
        );
    }
    // Another account and another pool still flow.
    host.forward(PATH, &[B]);
    host.forward("/v1/messages", &[A]);
    assert_eq!(host.metrics.count_of(0, Counter::LocalRejectCooldown), 100);
    // At the deadline, traffic flows again.
    host.advance(100 + GRAIN);
    host.forward(PATH, &[A]);
}

#[test]
fn local_answers_spread_clients_over_the_jitter_window() {
    let mut host = Host::new(CFG);
    host.rng.set(0.5);
    let flow = host.forward(PATH, &[A]);
    host.respond(&flow, 429, &[("retry-after", "10")], RL);
    host.advance(9_900);
    let h = local(&mut host, PATH, &[A]);
    // 100 ms left (and the grain), plus half of 20 % of the 10 s period: clients answered late
    // in a cooldown do not all come back on the deadline's millisecond.
    assert_eq!(
        header(&h, "retry-after-ms"),
        (100 + GRAIN + 1000).to_string()
    );
}

#[test]
fn quota_is_remembered_for_quota_ms_and_says_do_not_retry() {
    let mut host = Host::new(r#"{"cooldown": {"quota_ms": 120000}}"#);
    let flow = host.forward(PATH, &[A]);
    let g = host
        .respond(&flow, 429, &[], QUOTA)
        .unwrap_or_else(|| panic!("not governed"));
    assert_eq!(header(&g.headers, "x-should-retry"), "false");
    host.advance(119_000);
    let h = local(&mut host, PATH, &[A]);
    assert_eq!(header(&h, "x-should-retry"), "false");
    assert_eq!(header(&h, "x-llm-governor-class"), "quota_exhausted");
    assert_eq!(host.metrics.count_of(0, Counter::LocalRejectQuota), 1);
    host.advance(1_000 + GRAIN);
    host.forward(PATH, &[A]);
}

#[test]
fn recooling_keeps_the_later_deadline() {
    let mut host = Host::new(CFG);
    let f1 = host.forward(PATH, &[A]);
    let f2 = host.forward(PATH, &[A]);
    host.respond(&f1, 429, &[("retry-after", "10")], RL);
    host.respond(&f2, 429, &[("retry-after", "1")], RL);
    host.advance(5_000);
    local(&mut host, PATH, &[A]);
}

#[test]
fn overload_cools_only_when_the_provider_gave_a_time() {
    let mut host = Host::new(CFG);
    let f = host.forward("/v1/messages", &[A]);
    host.respond(
        &f,
        529,
        &[],
        r#"{"type":"error","error":{"type":"overloaded_error"}}"#,
    );
    host.forward("/v1/messages", &[A]);
    let f = host.forward("/v1/messages", &[A]);
    host.respond(&f, 503, &[("retry-after", "2")], "");
    let h = local(&mut host, "/v1/messages", &[A]);
    assert_eq!(header(&h, "x-llm-governor-class"), "overloaded");
}

#[test]
fn cooldown_max_caps_the_cooldown_and_the_cap_never_shortens_it() {
    let mut host = Host::new(r#"{"retry_after": {"max_ms": 2000}, "cooldown": {"max_ms": 8000}}"#);
    let f = host.forward(PATH, &[A]);
    let g = host.respond(&f, 429, &[("retry-after", "30")], RL);
    assert_eq!(g.map(|g| g.delay_ms), Some(2000));
    // A client that comes back at the cap is answered locally, at no upstream cost...
    host.advance(2_000);
    let h = local(&mut host, PATH, &[A]);
    assert_eq!(
        header(&h, "retry-after-ms"),
        "2000",
        "the cap still shortens what it is told"
    );
    // ...until cooldown.max_ms (8 s, not the provider's 30 s) and the clock's grain have
    // passed, to the millisecond.
    host.advance(5_999 + GRAIN);
    local(&mut host, PATH, &[A]);
    host.advance(1);
    host.forward(PATH, &[A]);
}

#[test]
fn preemptive_cooldown_when_nothing_is_left() {
    for (path, headers) in [
        (
            PATH,
            vec![
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", "3s"),
            ],
        ),
        (
            "/v1/messages",
            vec![
                ("anthropic-ratelimit-tokens-remaining", "0"),
                ("anthropic-ratelimit-tokens-reset", "2026-11-30T16:20:03Z"),
            ],
        ),
    ] {
        let mut host = Host::new(CFG);
        let f = host.forward(path, &[A]);
        assert!(host.respond(&f, 200, &headers, "{}").is_none());
        let h = local(&mut host, path, &[A]);
        assert_eq!(header(&h, "x-llm-governor-source"), "cooldown");
        host.advance(3_000 + GRAIN);
        host.forward(path, &[A]);
    }
}

#[test]
fn preemptive_off_and_cooldown_off_forward_everything() {
    let mut host = Host::new(r#"{"preemptive": false}"#);
    let f = host.forward(PATH, &[A]);
    host.respond(
        &f,
        200,
        &[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "3s"),
        ],
        "{}",
    );
    host.forward(PATH, &[A]);

    let mut host = Host::new(r#"{"cooldown": {"enabled": false}}"#);
    let f = host.forward(PATH, &[A]);
    host.respond(&f, 429, &[("retry-after", "30")], RL);
    host.forward(PATH, &[A]);
    assert!(host.store.is_empty());
}

#[test]
fn local_bodies_speak_the_pool_dialect() {
    let mut host = Host::new(CFG);
    for (path, needle) in [
        (PATH, r#""code":"rate_limit_exceeded""#),
        ("/v1/messages", r#""type":"rate_limit_error""#),
    ] {
        let f = host.forward(path, &[A]);
        host.respond(&f, 429, &[("retry-after", "5")], RL);
        match host.request(path, &[A]) {
            Decision::Reply(r) => {
                let body = String::from_utf8_lossy(&r.body).into_owned();
                assert!(body.contains(needle), "{path}: {body}");
                let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
                assert!(v.is_object(), "{path}: body is JSON");
            }
            Decision::Forward(_) => panic!("{path}: forwarded"),
        }
    }
}

#[test]
fn credentials_are_never_stored_and_one_key_is_one_account() {
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[("authorization", "Bearer sk-secret-123")]);
    host.respond(&f, 429, &[("retry-after", "5")], RL);
    let f2 = host.forward("/v1/messages", &[("x-api-key", "sk-secret-123")]);
    assert_eq!(f.account, f2.account);
    assert_eq!(f.account, host.governor().id(b"sk-secret-123"));
    let dump = host.store.dump();
    assert!(!dump.is_empty());
    for (k, v) in dump {
        assert!(
            !k.contains("secret") && !String::from_utf8_lossy(&v).contains("secret"),
            "{k}"
        );
    }
}

#[test]
fn failed_rounds_stretch_what_clients_are_told_until_a_success() {
    let mut host = Host::new(r#"{"retry_after": {"escalate": true}}"#);
    // The provider keeps saying "1 s" while it stays down.
    let answer = |host: &mut Host, f: &Sent| {
        host.respond(f, 429, &[("retry-after", "1")], RL)
            .map(|g| g.delay_ms)
            .unwrap_or(0)
    };
    let told = |host: &mut Host| {
        let f = host.forward(PATH, &[A]);
        answer(host, &f)
    };
    let in_flight = host.forward(PATH, &[A]);
    assert_eq!(told(&mut host), 1000);
    // A second 429 of the same round (it was in flight) is not a failed round.
    assert_eq!(answer(&mut host, &in_flight), 1000);
    host.advance(1000 + GRAIN);
    // The probe at the deadline fails: round 2, clients are told 2 s...
    assert_eq!(told(&mut host), 2000);
    // ...and so are clients answered locally during it (0.8 s left plus one extra period).
    host.advance(200);
    let h = local(&mut host, PATH, &[A]);
    assert_eq!(
        header(&h, "retry-after-ms"),
        (800 + GRAIN + 1000).to_string()
    );
    host.advance(800 + GRAIN);
    assert_eq!(told(&mut host), 4000);
    // A success ends the streak.
    host.advance(1000 + GRAIN);
    let f = host.forward(PATH, &[A]);
    host.respond(&f, 200, &[], "{}");
    assert_eq!(told(&mut host), 1000);
}

#[test]
fn without_escalate_clients_are_told_the_provider_time_every_round() {
    let mut host = Host::new(CFG);
    for _ in 0..3 {
        let f = host.forward(PATH, &[A]);
        let g = host.respond(&f, 429, &[("retry-after", "1")], RL);
        assert_eq!(g.map(|g| g.delay_ms), Some(1000));
        host.advance(1000 + GRAIN);
    }
}

/// Two "2 s" answers of one burst, the second `later_ms` after the first: within 20 % of 2 s it
/// repeats the first's statement and the deadline stays the first's; beyond, it moves.
#[test]
fn a_later_answer_moves_the_deadline_only_beyond_the_jitter_band() {
    // After `ms` more, a request of account A is forwarded (true) or answered locally.
    type Then = (u64, bool);
    // (configuration, the second answer's delay after the first, then what follows).
    let rows: [(&str, u64, &[Then]); 2] = [
        // Without holding: a client told the first answer's time is let through then. (With
        // holding, a request meeting the burst is held to its end instead: tests/hold.rs.)
        (CFG_NO_HOLD, 300, &[(1_700 + GRAIN, true)]),
        (CFG, 500, &[(1_500, false), (500 + GRAIN, true)]),
    ];
    for (cfg, later_ms, steps) in rows {
        let mut host = Host::new(cfg);
        let first = host.forward(PATH, &[A]);
        let late = host.forward(PATH, &[A]);
        host.respond(&first, 429, &[("retry-after", "2")], RL);
        host.advance(later_ms);
        host.respond(&late, 429, &[("retry-after", "2")], RL);
        for &(ms, forwarded) in steps {
            host.advance(ms);
            if forwarded {
                host.forward(PATH, &[A]);
            } else {
                local(&mut host, PATH, &[A]);
            }
        }
    }
}

/// README, "How it works", Cooldowns: a cooldown that starts while the previous one of the
/// same class would still be spreading its clients (within that one's period after it ended)
/// belongs to the same episode, and clients answered locally during it are spread over the
/// episode's longest period, not over its own (proposed README text in the issue-13 report).
#[test]
fn short_cooldowns_in_an_episode_keep_its_spread() {
    let mut host = Host::new(CFG);
    host.rng.set(0.5);
    let f = host.forward(PATH, &[A]);
    host.respond(&f, 429, &[("retry-after", "3")], RL);
    host.advance(3_000 + GRAIN);
    // The window reopens one slot at a time: a 2xx reports nothing left for 40 ms.
    let f = host.forward(PATH, &[A]);
    host.respond(
        &f,
        200,
        &[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "40ms"),
        ],
        "{}",
    );
    let h = local(&mut host, PATH, &[A]);
    // 40 ms left (and the grain), plus half of 20 % of the episode's 3 s period (not of 40 ms).
    assert_eq!(header(&h, "retry-after-ms"), (40 + GRAIN + 300).to_string());
}

#[test]
fn a_one_second_hint_cools_only_until_the_providers_exact_reset() {
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[A]);
    let h = [
        ("retry-after", "1"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "12ms"),
    ];
    let g = host.respond(&f, 429, &h, RL);
    // The client is told the provider's 1 s...
    assert_eq!(g.map(|g| g.delay_ms), Some(1000));
    // ...but the window frees its slot after 12 ms, and so does the cooldown.
    host.advance(5);
    local(&mut host, PATH, &[A]);
    host.advance(7 + GRAIN);
    host.forward(PATH, &[A]);
    // Longer whole-second hints, and hints in ms, are kept as they are.
    let mut host = Host::new(CFG);
    let f = host.forward(PATH, &[A]);
    let h = [
        ("retry-after", "2"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "1.5s"),
    ];
    host.respond(&f, 429, &h, RL);
    host.advance(1_999);
    local(&mut host, PATH, &[A]);
}

#[test]
fn once_a_round_failed_the_later_of_the_stated_time_and_the_exhausted_reset_is_believed() {
    // An outage whose 429s all say `retry-after: 1` while the window's reset tells its rest.
    let mut host = Host::new(CFG);
    let outage = |rest: &'static str| {
        [
            ("retry-after", "1"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", rest),
        ]
    };
    // The first round believes the stated second: providers' resets are when the limit is
    // whole again, usually later than the next admission.
    let f = host.forward(PATH, &[A]);
    let g = host.respond(&f, 429, &outage("2.5s"), RL);
    assert_eq!(g.map(|g| g.delay_ms), Some(1000));
    host.advance(1_000 + GRAIN);
    // Its probe meets another 429: the second second was too short too, and the reset is
    // believed, for the cooldown and for what the client is told.
    let probe = host.forward(PATH, &[A]);
    let g = host.respond(&probe, 429, &outage("1.5s"), RL);
    assert_eq!(g.map(|g| g.delay_ms), Some(1500));
    host.advance(1_499);
    local(&mut host, PATH, &[A]);
    host.advance(1 + GRAIN);
    host.forward(PATH, &[A]);
}

#[test]
fn a_provider_time_after_a_short_preemptive_cooldown_is_never_banded_away() {
    // Two requests in flight at the end of a cooldown: without the pace (hold off).
    let mut host = Host::new(CFG_NO_HOLD);
    let f = host.forward(PATH, &[A]);
    host.respond(&f, 429, &[("retry-after", "3")], RL);
    host.advance(3_000 + GRAIN);
    let f = host.forward(PATH, &[A]);
    let racing = host.forward(PATH, &[A]);
    host.respond(
        &f,
        200,
        &[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "40ms"),
        ],
        "{}",
    );
    // A request that raced the 2xx is refused with its own time, 300 ms beyond the 40 ms
    // cooldown: within the episode's 600 ms spread, but a different statement, so it holds.
    host.respond(&racing, 429, &[("retry-after-ms", "340")], RL);
    host.advance(339 + GRAIN);
    local(&mut host, PATH, &[A]);
    host.advance(1);
    host.forward(PATH, &[A]);
}

/// The stored layouts, byte for byte: shared data outlives the VM that wrote it (a module
/// updated in a running Envoy reads the records its previous build left), so no field may
/// move.
#[test]
fn records_keep_their_byte_layouts() {
    use llm_governor_core::bucket::Bucket;
    use llm_governor_core::classify::Class;
    use llm_governor_core::cooldown::{CooldownRecord, Pace};
    let rec = CooldownRecord {
        deadline_ms: 0x0102_0304_0506_0708,
        period_ms: 0x1112_1314,
        spread_ms: 0x2122_2324,
        class: Class::QuotaExhausted,
        streak: 5,
        pace: Pace {
            active: true,
            ignore_remaining: true,
            credits: 0x3132,
            out: 0x4142,
            last_release_ms: 0x5152_5354_5556_5758,
            seq: 0x7172,
        },
        burst_end_ms: 0x6162_6364_6566_6768,
    };
    let want: [u8; 41] = [
        8, 7, 6, 5, 4, 3, 2, 1, // deadline_ms
        0x14, 0x13, 0x12, 0x11, // period_ms
        0x24, 0x23, 0x22, 0x21, // spread_ms
        2, 5, 3, // class, streak, pace flags
        0x32, 0x31, 0x42, 0x41, // credits, out
        0x58, 0x57, 0x56, 0x55, 0x54, 0x53, 0x52, 0x51, // last_release_ms
        0x68, 0x67, 0x66, 0x65, 0x64, 0x63, 0x62, 0x61, // burst_end_ms
        0x72, 0x71, // pace release count
    ];
    assert_eq!(rec.encode(), want);
    assert_eq!(CooldownRecord::decode(&want), Some(rec));
    let mut bad = want;
    bad[18] = 4; // an unknown pace flag
    assert_eq!(CooldownRecord::decode(&bad), None);
    assert_eq!(CooldownRecord::decode(&want[..40]), None);

    let b = Bucket {
        level: -2,
        updated_ms: 0x0102_0304_0506_0708,
    };
    let want: [u8; 16] = [
        0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 8, 7, 6, 5, 4, 3, 2, 1,
    ];
    assert_eq!(b.encode(), want);
    assert_eq!(Bucket::decode(&want), Some(b));
}

/// The other two stored layouts, byte for byte, for the same reason.
#[test]
fn slot_rings_and_key_counts_keep_their_byte_layouts() {
    use llm_governor_core::inflight::Slots;
    use llm_governor_core::store::Record;
    let s = Slots {
        newest: 0x0102_0304_0506_0708,
        counts: [1, 0x0a0b_0c0d, 3, u32::MAX],
    };
    let want: [u8; 24] = [
        8, 7, 6, 5, 4, 3, 2, 1, // newest epoch
        1, 0, 0, 0, // its count
        0x0d, 0x0c, 0x0b, 0x0a, // the epoch before
        3, 0, 0, 0, // and before that
        0xff, 0xff, 0xff, 0xff, // the oldest
    ];
    assert_eq!(s.encode(), want);
    assert_eq!(Slots::decode(&want), Some(s));
    assert_eq!(Slots::decode(&want[..23]), None);

    let want = [8, 7, 6, 5, 4, 3, 2, 1];
    assert_eq!(0x0102_0304_0506_0708u64.to_bytes(), want);
    assert_eq!(u64::from_bytes(&want), Some(0x0102_0304_0506_0708));
    assert_eq!(u64::from_bytes(&want[..7]), None);
}
