//! Properties of what clients are told and how long a cooldown lasts, checked on generated
//! inputs (proptest): (a) no delay told is below the provider's, alone and end to end through
//! the rewritten headers; (b) a merged cooldown never ends before an answer's deadline, but
//! for the band `cooldown::merge` documents.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::props::config;
use common::{header, Decision, FixedRng, Host, T0};
use llm_governor_core::classify::Class;
use llm_governor_core::config::RetryAfter;
use llm_governor_core::cooldown::{self, CooldownRecord, Wanted};
use llm_governor_core::retry_after;
use llm_governor_core::time::MAX_PARSED_MS;
use proptest::prelude::*;

const RL_BODY: &str = r#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on requests per min (RPM): Limit 500, Used 500, Requested 1.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;

/// Randomness as the host would draw it, and values it never should (NaN, negative, > 1).
fn rng_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 0.0..1.0f64,
        1 => Just(0.999_999_999),
        1 => proptest::num::f64::ANY,
    ]
}

/// A `retry_after` section that `config::parse` accepts.
fn retry_after_cfg() -> impl Strategy<Value = RetryAfter> {
    (
        prop_oneof![1..=120_000u64, 1..=604_800_000u64],
        0.0..=1.0f64,
        any::<bool>(),
    )
        .prop_flat_map(|(max_ms, jitter, escalate)| {
            (1..=max_ms).prop_map(move |default_ms| RetryAfter {
                default_ms,
                max_ms,
                jitter,
                escalate,
            })
        })
}

/// How a provider states its delay.
#[derive(Clone, Debug)]
enum Hint {
    Ms(u64),
    Seconds(u64),
    /// Both: `retry-after-ms` wins.
    Both {
        ms: u64,
        seconds: u64,
    },
}

impl Hint {
    fn headers(&self) -> Vec<(String, String)> {
        match *self {
            Hint::Ms(ms) => vec![("retry-after-ms".into(), ms.to_string())],
            Hint::Seconds(s) => vec![("retry-after".into(), s.to_string())],
            Hint::Both { ms, seconds } => vec![
                ("retry-after".into(), seconds.to_string()),
                ("retry-after-ms".into(), ms.to_string()),
            ],
        }
    }

    /// The provider's time in ms, as the contract reads it (capped at one year).
    fn provider_ms(&self) -> u64 {
        match *self {
            Hint::Ms(ms) | Hint::Both { ms, .. } => ms,
            Hint::Seconds(s) => s.saturating_mul(1000),
        }
        .min(MAX_PARSED_MS)
    }
}

fn hint() -> impl Strategy<Value = Hint> {
    let ms = prop_oneof![1..=2_000u64, 1..=600_000u64, 1..=u64::MAX];
    let seconds = prop_oneof![1..=60u64, 1..=100_000u64, 1..=u64::MAX / 1000];
    prop_oneof![
        ms.clone().prop_map(Hint::Ms),
        seconds.clone().prop_map(Hint::Seconds),
        (ms, seconds).prop_map(|(ms, seconds)| Hint::Both { ms, seconds }),
    ]
}

proptest! {
    #![proptest_config(config(512))]

    /// (a) The delay a client is told is never below the provider's (up to the cap), whatever
    /// the jitter config and whatever the randomness returns.
    #[test]
    fn told_is_never_less_than_the_provider_time(
        provider_ms in prop_oneof![0..=10_000u64, any::<u64>()],
        spread_ms in prop_oneof![0..=10_000u64, any::<u64>()],
        cfg in retry_after_cfg(),
        u in rng_value(),
    ) {
        let told = retry_after::told(provider_ms, spread_ms, &cfg, &mut FixedRng::new(u));
        prop_assert!(told >= provider_ms.min(cfg.max_ms).max(1), "told {told}");
        prop_assert!(told <= cfg.max_ms, "told {told} above max_ms {}", cfg.max_ms);
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// (a) The same, end to end: a 429/503/529 carrying the hint is rewritten to at least the
    /// provider's time in both header forms, and so is every local answer while the cooldown
    /// it started runs.
    #[test]
    fn governed_headers_never_say_less_than_the_provider(
        hint in hint(),
        cfg in retry_after_cfg(),
        status in prop_oneof![Just(429u16), Just(503), Just(529)],
        u in rng_value(),
        later in 0.0..1.0f64,
    ) {
        let json = format!(
            r#"{{"retry_after": {{"default_ms": {}, "max_ms": {}, "jitter": {}, "escalate": {}}},
                 "cooldown": {{"max_ms": 604800000}}}}"#,
            cfg.default_ms, cfg.max_ms, cfg.jitter, cfg.escalate
        );
        let mut host = Host::new(&json);
        host.rng.set(u);
        let provider = hint.provider_ms();
        let floor = provider.min(cfg.max_ms);
        let hs = hint.headers();
        let hs: Vec<(&str, &str)> = hs.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let flow = host.forward("/v1/chat/completions", &[("authorization", "Bearer sk-p")]);
        let body = if status == 429 { RL_BODY } else { "" };
        let g = host.respond(&flow, status, &hs, body);
        let g = g.unwrap_or_else(|| panic!("{status} not governed"));
        prop_assert!(g.delay_ms >= floor, "told {} < {floor}", g.delay_ms);
        let ms: u64 = header(&g.headers, "retry-after-ms").parse().unwrap();
        let secs: u64 = header(&g.headers, "retry-after").parse().unwrap();
        prop_assert_eq!(ms, g.delay_ms);
        prop_assert!(secs.saturating_mul(1000) >= floor, "retry-after {secs} s < {floor} ms");

        // Later in the cooldown (it lasts the provider's time, at most cooldown.max_ms).
        let cooling = provider.min(604_800_000);
        let elapsed = ((cooling as f64) * later) as u64;
        host.advance(elapsed);
        let left = cooling - elapsed;
        match host.request("/v1/chat/completions", &[("authorization", "Bearer sk-p")]) {
            Decision::Reply(r) => {
                let ms: u64 = header(&r.headers, "retry-after-ms").parse().unwrap();
                let secs: u64 = header(&r.headers, "retry-after").parse().unwrap();
                let floor = left.min(cfg.max_ms);
                prop_assert!(ms >= floor, "local answer {ms} < {floor} ms left");
                prop_assert!(secs.saturating_mul(1000) >= floor);
            }
            Decision::Forward(_) => {
                prop_assert_eq!(left, 0, "forwarded with {} ms of cooldown left", left);
            }
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// (a) A unit test of the response room, without the worker: every hint is read as the
    /// provider's time, and the delay it decides is the one its header says (the client sees
    /// only the headers, checked above).
    #[test]
    fn the_response_room_reads_every_hint_as_the_provider_time(
        hint in hint(),
        status in prop_oneof![Just(429u16), Just(503), Just(529)],
    ) {
        let mut host = Host::new("{}");
        let hs: Vec<(String, Vec<u8>)> =
            hint.headers().into_iter().map(|(n, v)| (n, v.into_bytes())).collect();
        let flow = host.forward("/v1/chat/completions", &[("authorization", "Bearer sk-p")]);
        let body = if status == 429 { RL_BODY } else { "" };
        let g = host.response_room(&flow, status, &hs, body.as_bytes());
        let g = g.unwrap_or_else(|| panic!("{status} not governed"));
        prop_assert_eq!(g.provider_ms, Some(hint.provider_ms()));
        let ms: u64 = header(&g.headers, "retry-after-ms").parse().unwrap();
        prop_assert_eq!(ms, g.delay_ms);
    }
}

/// One answer of the provider, as the policy merges it: `after_ms` after the previous one,
/// a cooldown of `ms` of `class` (None: an answer that gave no time).
#[derive(Clone, Debug)]
struct Answer {
    after_ms: u64,
    wanted: Option<(Class, u64)>,
    streak: u8,
}

fn class() -> impl Strategy<Value = Class> {
    prop_oneof![
        Just(Class::RateLimited),
        Just(Class::QuotaExhausted),
        Just(Class::Overloaded)
    ]
}

fn answers() -> impl Strategy<Value = Vec<Answer>> {
    // Few distinct periods, so that bursts repeating one statement are common.
    let ms = prop_oneof![
        4 => prop::sample::select(vec![0u64, 1, 250, 999, 1000, 2000, 60_000]),
        2 => 0..=120_000u64,
        1 => Just(u64::from(u32::MAX) + 7),
    ];
    let answer = (
        prop_oneof![3 => 0..=300u64, 1 => 0..=150_000u64],
        prop::option::weighted(0.85, (class(), ms)),
        any::<u8>(),
    )
        .prop_map(|(after_ms, wanted, streak)| Answer {
            after_ms,
            wanted,
            streak,
        });
    prop::collection::vec(answer, 1..24)
}

proptest! {
    #![proptest_config(config(512))]

    /// (b) A merged cooldown never ends before an answer's deadline, except as `merge`
    /// documents: an answer repeating the running cooldown's statement (same class, same
    /// period, the cooldown still running) whose deadline lies within `period * jitter` of it
    /// keeps the earlier deadline. The deadline never moves earlier, and an answer with no time
    /// leaves it as it was.
    #[test]
    fn cooldown_merge_never_ends_before_the_provider_deadline(
        start in prop_oneof![Just(0u64), Just(T0), any::<u64>()],
        answers in answers(),
        jitter in prop_oneof![Just(0.0), Just(0.2), Just(1.0), 0.0..=1.0f64],
    ) {
        let mut rec: Option<CooldownRecord> = None;
        let mut now = start;
        // Every deadline an answer asked for, and how much earlier the band lets the
        // record's deadline be (0 when the answer did not repeat the running statement).
        let mut asked: Vec<(u64, f64)> = Vec::new();
        for a in &answers {
            now = now.saturating_add(a.after_ms);
            let wanted = a.wanted.map(|(class, ms)| Wanted { class, ms });
            let next = cooldown::merge(rec, wanted, a.streak, now, jitter);
            let before = rec.map_or(0, |r| r.deadline_ms);
            prop_assert!(next.deadline_ms >= before, "deadline moved earlier");
            prop_assert_eq!(next.streak, a.streak);
            match wanted {
                None => prop_assert_eq!(next.deadline_ms, before),
                Some(w) => {
                    let period = u32::try_from(w.ms).unwrap_or(u32::MAX);
                    let repeats = rec.is_some_and(|r| {
                        r.deadline_ms > now && r.class == w.class && r.period_ms == period
                    });
                    let band = if repeats { f64::from(period) * jitter } else { 0.0 };
                    asked.push((now.saturating_add(w.ms), band));
                }
            }
            for (deadline, band) in &asked {
                if next.deadline_ms < *deadline {
                    prop_assert!(
                        (*deadline - next.deadline_ms) as f64 <= *band,
                        "deadline {} ends {} ms before an answer's {deadline} (band {band})",
                        next.deadline_ms,
                        deadline - next.deadline_ms
                    );
                }
            }
            rec = Some(next);
        }
    }
}
