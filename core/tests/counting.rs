//! Counting as the provider counts (issue 32): one table of dialect × usage shape (real
//! provider answers, JSON and SSE) → what each dimension counts; what a reserving limit takes
//! before the call by each provider's rule; and an Anthropic agent through the worker, its
//! cached system prompt and short answers predicted, settled with the usage.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::{Decision, Host, Sent};
use llm_governor_core::classify::Dialect;
use llm_governor_core::config::{self, Counts, Settle};
use llm_governor_core::counting::{self, Count, Prediction, Reserve};
use llm_governor_core::estimate::Estimate;
use llm_governor_core::metrics::Histogram;
use llm_governor_core::usage::{Usage, UsageScanner};

const ANTHROPIC_CACHE_READ: &str = r#"{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Done."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":0,"cache_read_input_tokens":10240,"cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":0},"output_tokens":187,"service_tier":"standard"}}"#;
const ANTHROPIC_CACHE_WRITE: &str = r#"{"id":"msg_01","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[{"type":"text","text":"Hi"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":3,"cache_creation_input_tokens":10240,"cache_read_input_tokens":0,"output_tokens":55,"service_tier":"standard"}}"#;
/// Anthropic's stream: usage in `message_start` (output 1 so far), the output in `message_delta`.
const ANTHROPIC_SSE: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":300,\"cache_read_input_tokens\":10240,\"output_tokens\":1}}}\n\nevent: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\nevent: ping\ndata: {\"type\": \"ping\"}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\nevent: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":212}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
const OPENAI_CACHED: &str = r#"{"id":"chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG","object":"chat.completion","created":1741570283,"model":"gpt-4o-2024-08-06","choices":[{"index":0,"message":{"role":"assistant","content":"ok","refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":1117,"completion_tokens":46,"total_tokens":1163,"prompt_tokens_details":{"cached_tokens":1024,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"service_tier":"default","system_fingerprint":"fp_fc9f1d7035"}"#;
const OPENAI_SSE_USAGE: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\ndata: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":30,\"completion_tokens\":7,\"total_tokens\":37,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n";
const GEMINI: &str = r#"{"candidates":[{"content":{"parts":[{"text":"ok"}],"role":"model"},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":1200,"candidatesTokenCount":50,"totalTokenCount":1290,"cachedContentTokenCount":1000,"promptTokensDetails":[{"modality":"TEXT","tokenCount":1200}],"thoughtsTokenCount":40},"modelVersion":"gemini-2.5-flash"}"#;
const GEMINI_NO_TOTAL: &str =
    r#"{"candidates":[],"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":3}}"#;

fn scanned(body: &str) -> Usage {
    let mut s = UsageScanner::new();
    // Cut in two at an awkward place, as a stream arrives.
    let cut = body.len() / 3;
    s.feed(&body.as_bytes()[..cut]);
    s.feed(&body.as_bytes()[cut..]);
    s.usage().unwrap_or_else(|| panic!("no usage in {body}"))
}

/// Dialect × usage shape → (input, output) counted, without and with `count_cache_reads`.
#[test]
fn each_provider_counts_its_own_dimensions() {
    /// (name, dialect, answer, (input, output) with cache reads free, with them counted)
    type Row = (&'static str, Dialect, &'static str, (u64, u64), (u64, u64));
    let rows: [Row; 7] = [
        // Anthropic: cache reads are free unless the model counts them; writes count.
        (
            "anthropic read",
            Dialect::Anthropic,
            ANTHROPIC_CACHE_READ,
            (12, 187),
            (10_252, 187),
        ),
        (
            "anthropic write",
            Dialect::Anthropic,
            ANTHROPIC_CACHE_WRITE,
            (10_243, 55),
            (10_243, 55),
        ),
        (
            "anthropic sse",
            Dialect::Anthropic,
            ANTHROPIC_SSE,
            (325, 212),
            (10_565, 212),
        ),
        // OpenAI: the cached tokens are inside prompt_tokens, and count.
        (
            "openai cached",
            Dialect::OpenAi,
            OPENAI_CACHED,
            (1117, 46),
            (1117, 46),
        ),
        (
            "openai sse",
            Dialect::AzureOpenAi,
            OPENAI_SSE_USAGE,
            (30, 7),
            (30, 7),
        ),
        // Gemini: the prompt (cached content inside it), the rest of the total as output
        // (candidates and thoughts).
        ("gemini", Dialect::Gemini, GEMINI, (1200, 90), (1200, 90)),
        (
            "gemini no total",
            Dialect::Gemini,
            GEMINI_NO_TOTAL,
            (8, 3),
            (8, 3),
        ),
    ];
    for (name, dialect, body, free_reads, counted_reads) in rows {
        let usage = scanned(body);
        for (reads, (input, output)) in [(false, free_reads), (true, counted_reads)] {
            let c = counting::counted(dialect, &usage, reads).unwrap();
            assert_eq!((c.input, c.output), (input, output), "{name} reads={reads}");
            assert_eq!(c.of(Counts::Tokens), input + output, "{name}");
            assert_eq!(c.of(Counts::InputTokens), input, "{name}");
            assert_eq!(c.of(Counts::OutputTokens), output, "{name}");
        }
    }
    // A usage that says nothing counted: None (the reservation stands).
    let nothing = Usage {
        cache_read: Some(5),
        ..Usage::default()
    };
    assert_eq!(counting::counted(Dialect::OpenAi, &nothing, false), None);
    assert_eq!(counting::counted(Dialect::Anthropic, &nothing, false), None);
    assert_eq!(
        counting::counted(Dialect::Anthropic, &nothing, true),
        Some(Count {
            input: 5,
            output: 0
        })
    );
}

fn limit(field: &str, extra: &str) -> config::Limit {
    let json = format!(r#"{{"limits":[{{"name":"l","key":"account","{field}":20000{extra}}}]}}"#);
    config::parse(json.as_bytes()).unwrap().limits.remove(0)
}

/// What a reserving limit takes before the call, one row per rule.
#[test]
fn a_reservation_follows_the_providers_rule() {
    // 10,500 tokens of prompt (of which 10,000 a remembered prefix), max_tokens 16,000.
    let est = Estimate {
        input: 10_500,
        max_output: Some(16_000),
        model: None,
        bytes: 44_000,
    };
    let cached = Prediction {
        uncached_input: Some(500),
        hit: Some(0),
        output: Some(280),
        input_per_mille: None,
    };
    let cold = Prediction::default();
    let none_max = Estimate {
        max_output: None,
        ..est
    };
    let u = Settle::Usage;
    let r = Settle::Reservation;
    type Row = (
        &'static str,
        &'static str,
        &'static str,
        Settle,
        Dialect,
        Estimate,
        Prediction,
        Reserve,
    );
    let rows: [Row; 12] = [
        // Anthropic: uncached input after a remembered prefix, output from recent usage.
        (
            "input_tokens_per_minute",
            "",
            "itpm hit",
            u,
            Dialect::Anthropic,
            est,
            cached,
            Reserve {
                amount: 500,
                firm: 500,
            },
        ),
        (
            "input_tokens_per_minute",
            "",
            "itpm cold",
            u,
            Dialect::Anthropic,
            est,
            cold,
            Reserve {
                amount: 10_500,
                firm: 10_500,
            },
        ),
        (
            "input_tokens_per_minute",
            r#","count_cache_reads":true"#,
            "itpm reads count",
            u,
            Dialect::Anthropic,
            est,
            cached,
            Reserve {
                amount: 10_500,
                firm: 10_500,
            },
        ),
        (
            "output_tokens_per_minute",
            "",
            "otpm learned",
            u,
            Dialect::Anthropic,
            est,
            cached,
            Reserve {
                amount: 280,
                firm: 0,
            },
        ),
        // Before any usage: the output limit, up to default_output_tokens (1024).
        (
            "output_tokens_per_minute",
            "",
            "otpm cold",
            u,
            Dialect::Anthropic,
            est,
            cold,
            Reserve {
                amount: 1024,
                firm: 0,
            },
        ),
        // The floor, and never above the request's own max_tokens.
        (
            "output_tokens_per_minute",
            r#","min_output_tokens":400"#,
            "otpm floor",
            u,
            Dialect::Anthropic,
            est,
            cached,
            Reserve {
                amount: 400,
                firm: 0,
            },
        ),
        (
            "output_tokens_per_minute",
            r#","min_output_tokens":400"#,
            "otpm under max",
            u,
            Dialect::Anthropic,
            Estimate {
                max_output: Some(100),
                ..est
            },
            cached,
            Reserve {
                amount: 100,
                firm: 0,
            },
        ),
        // The older rule: max_tokens reserved, and it can be too large for the bucket.
        (
            "output_tokens_per_minute",
            r#","output":"max_tokens""#,
            "otpm max_tokens",
            u,
            Dialect::Anthropic,
            est,
            cached,
            Reserve {
                amount: 16_000,
                firm: 16_000,
            },
        ),
        (
            "tokens_per_minute",
            "",
            "tpm anthropic",
            u,
            Dialect::Anthropic,
            est,
            cached,
            Reserve {
                amount: 780,
                firm: 500,
            },
        ),
        // OpenAI counts at admission: characters / 4 and max_tokens, whatever was predicted.
        (
            "tokens_per_minute",
            "",
            "tpm openai",
            r,
            Dialect::OpenAi,
            est,
            cached,
            Reserve {
                amount: 27_000,
                firm: 27_000,
            },
        ),
        (
            "output_tokens_per_minute",
            "",
            "otpm openai",
            u,
            Dialect::OpenAi,
            none_max,
            cached,
            Reserve {
                amount: 1024,
                firm: 1024,
            },
        ),
        // A prediction larger than the bucket is cut to it (Gemini counts generated output).
        (
            "output_tokens_per_minute",
            r#","burst":200"#,
            "otpm over burst",
            u,
            Dialect::Gemini,
            est,
            cached,
            Reserve {
                amount: 200,
                firm: 0,
            },
        ),
    ];
    for (field, extra, name, settle, dialect, est, predicted, want) in rows {
        let l = limit(field, extra);
        assert_eq!(
            counting::reservation(&l, settle, dialect, &est, &predicted),
            want,
            "{name}"
        );
    }
}

const POOL: &str =
    r#"{"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"}"#;

fn agent_config() -> String {
    format!(
        r#"{{"pools": [{POOL}], "limits": [
            {{"name": "itpm", "key": "account", "input_tokens_per_minute": 20000}},
            {{"name": "otpm", "key": "account", "output_tokens_per_minute": 6000}}]}}"#
    )
}

/// An agent's body as the Anthropic SDK sends it: a cached system prompt of about
/// `system_words` tokens, then the conversation so far with a breakpoint on its last block.
fn agent_body(system_words: usize, turns: &[&str]) -> Vec<u8> {
    let system = "word ".repeat(system_words);
    let n = turns.len();
    let messages: Vec<String> = turns
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let cc = if i + 1 == n {
                r#","cache_control":{"type":"ephemeral"}"#
            } else {
                ""
            };
            format!(r#"{{"role":"{role}","content":[{{"type":"text","text":"{t}"{cc}}}]}}"#)
        })
        .collect();
    format!(
        r#"{{"max_tokens":16000,"messages":[{}],"model":"claude-sonnet-4-5","system":[{{"type":"text","text":"{system}","cache_control":{{"type":"ephemeral"}}}}]}}"#,
        messages.join(",")
    )
    .into_bytes()
}

const KEY: (&str, &str) = ("x-api-key", "sk-ant-agent");

fn forward(h: &mut Host, body: &[u8]) -> Sent {
    match h.request_with_body(
        "/v1/messages",
        &[KEY, ("anthropic-version", "2023-06-01")],
        body,
    ) {
        Decision::Forward(f) => f,
        Decision::Reply(r) => panic!("answered locally: {r:?}"),
    }
}

fn reserved(flow: &llm_governor_core::request::Flow) -> Vec<u64> {
    flow.charges.iter().map(|c| c.reserved).collect()
}

#[test]
fn an_agent_reserves_what_the_provider_will_count() {
    let mut h = Host::new(&agent_config());
    let account = h.governor().id(b"sk-ant-agent");
    // The first call: nothing cached, no usage seen: all of its input, and 1,024 of output
    // (default_output_tokens), not its max_tokens of 16,000 (which the bucket cannot hold).
    let first = forward(
        &mut h,
        &agent_body(10_000, &["Fix the failing test in src/lib.rs."]),
    );
    let r = reserved(&first);
    assert!((10_000..11_000).contains(&r[0]), "{r:?}");
    assert_eq!(r[1], 1024);
    // It succeeds: the provider wrote the prefix and reported what it counted.
    let written = r#"{"type":"message","usage":{"input_tokens":4,"cache_creation_input_tokens":10230,"cache_read_input_tokens":0,"output_tokens":180}}"#;
    let json = [("content-type", "application/json")];
    assert!(h.respond(&first, 200, &json, written).is_none());
    h.end(&first);
    assert_eq!(h.bucket_tokens(0, account), Some(20_000 - 10_234));
    assert_eq!(h.bucket_tokens(1, account), Some(6_000 - 180));
    // The next turn reads the system prompt and the first turn from the cache: it reserves
    // the new turn's few tokens, and the output its model's recent usage says.
    let second = forward(
        &mut h,
        &agent_body(
            10_000,
            &[
                "Fix the failing test in src/lib.rs.",
                "I will read the file first.",
                "Here is src/lib.rs: fn main() {}",
            ],
        ),
    );
    let r = reserved(&second);
    assert!(r[0] < 60, "{r:?}");
    assert_eq!(r[1], 180);
    assert!(second.prediction().hit.is_some());
    // A longer answer than predicted is charged in full at the end; the input as counted.
    let long = r#"{"type":"message","usage":{"input_tokens":3,"cache_creation_input_tokens":24,"cache_read_input_tokens":10230,"output_tokens":900}}"#;
    h.respond(&second, 200, &json, long);
    h.end(&second);
    assert_eq!(h.bucket_tokens(0, account), Some(20_000 - 10_234 - 27));
    assert_eq!(h.bucket_tokens(1, account), Some(6_000 - 180 - 900));
    // Both predictions' errors are stats.
    let errs: Vec<(Histogram, u64)> = h
        .metrics
        .prediction_error_pct
        .iter()
        .map(|(_, which, pct)| (*which, *pct))
        .collect();
    assert!(
        errs.contains(&(Histogram::OutputPredictionErrorPct, 80)),
        "{errs:?}"
    );
    assert_eq!(
        errs.iter()
            .filter(|(w, _)| *w == Histogram::InputPredictionErrorPct)
            .count(),
        2
    );
    // Another account has nothing cached: the same body reserves all of its input.
    let other = h.request_with_body(
        "/v1/messages",
        &[
            ("x-api-key", "sk-ant-other"),
            ("anthropic-version", "2023-06-01"),
        ],
        &agent_body(10_000, &["Fix the failing test in src/lib.rs."]),
    );
    let Decision::Forward(other) = other else {
        panic!("answered")
    };
    assert!(reserved(&other)[0] >= 10_000);
}

#[test]
fn a_failed_call_remembers_nothing_and_the_old_rule_reserves_max_tokens() {
    let mut h = Host::new(&agent_config());
    let body = agent_body(2_000, &["hello"]);
    let first = forward(&mut h, &body);
    // A 400 (the provider refused the request): nothing was cached.
    let bad = r#"{"type":"error","error":{"type":"invalid_request_error","message":"bad"}}"#;
    h.respond(&first, 400, &[], bad);
    h.end(&first);
    let again = forward(&mut h, &body);
    assert_eq!(again.prediction().hit, None);
    assert!(reserved(&again)[0] >= 2_000);
    // `output: "max_tokens"`: 16,000 reserved can never fit 6,000: refused for good.
    let mut h = Host::new(&agent_config().replace(
        r#""output_tokens_per_minute": 6000"#,
        r#""output_tokens_per_minute": 6000, "output": "max_tokens""#,
    ));
    match h.request_with_body("/v1/messages", &[KEY], &body) {
        Decision::Reply(r) => assert_eq!(r.status, 429),
        Decision::Forward(_) => panic!("a reservation over the burst went"),
    }
}

#[test]
fn a_usage_that_contradicts_the_prediction_is_corrected() {
    let mut h = Host::new(&agent_config());
    let account = h.governor().id(b"sk-ant-agent");
    let json = [("content-type", "application/json")];
    let body = agent_body(5_000, &["Start."]);
    let first = forward(&mut h, &body);
    let wrote = r#"{"usage":{"input_tokens":2,"cache_creation_input_tokens":5100,"cache_read_input_tokens":0,"output_tokens":60}}"#;
    h.respond(&first, 200, &json, wrote);
    h.end(&first);
    let before = h.bucket_tokens(0, account).unwrap();
    // Predicted a read of the whole prompt; the provider had evicted it and wrote it again:
    // the settle charges what it counted, not what was reserved.
    let second = forward(&mut h, &body);
    assert!(second.prediction().hit.is_some());
    assert!(reserved(&second)[0] < 50);
    let evicted = r#"{"usage":{"input_tokens":2,"cache_creation_input_tokens":5100,"cache_read_input_tokens":0,"output_tokens":60}}"#;
    h.respond(&second, 200, &json, evicted);
    h.end(&second);
    assert_eq!(h.bucket_tokens(0, account), Some(before - 5_102));
}

#[test]
fn remembered_prefixes_count_against_max_keys() {
    use llm_governor_core::metrics::Counter;
    // The two buckets of the agent take both keys: nothing is left to remember prefixes in.
    let mut h = Host::new(&agent_config().replacen('{', r#"{"max_keys": 2, "#, 1));
    let json = [("content-type", "application/json")];
    let body = agent_body(2_000, &["Start."]);
    let first = forward(&mut h, &body);
    let wrote = r#"{"usage":{"input_tokens":2,"cache_creation_input_tokens":2100,"cache_read_input_tokens":0,"output_tokens":60}}"#;
    h.respond(&first, 200, &json, wrote);
    h.end(&first);
    assert!(h.metrics.count_of(0, Counter::OverflowKeys) >= 1);
    // Not remembered: the next request reserves its whole prompt, as it should.
    let second = forward(&mut h, &body);
    assert_eq!(second.prediction().hit, None);
    assert!(reserved(&second)[0] >= 2_000);
}

#[test]
fn a_held_request_learns_the_cache_while_it_waits() {
    use common::Step;
    let mut h = Host::new(&agent_config());
    let json = [("content-type", "application/json")];
    let body = agent_body(11_000, &["Start."]);
    let headers = [KEY, ("anthropic-version", "2023-06-01")];
    let Step::Go(first) = h.arrive_with_body(1, "/v1/messages", &headers, &body) else {
        panic!("the first request waits for nothing")
    };
    // The same prompt at once: its whole input does not fit what is left (a few seconds of
    // refill): held, not answered.
    assert!(matches!(
        h.arrive_with_body(2, "/v1/messages", &headers, &body),
        Step::Held
    ));
    // The first answer says the prompt is in the cache now: when the held one asks again (its
    // wait, the refill of the input it lacked, is over), it reserves only what follows the
    // prefix.
    let wrote = r#"{"usage":{"input_tokens":3,"cache_creation_input_tokens":11050,"cache_read_input_tokens":0,"output_tokens":90}}"#;
    h.respond(&first, 200, &json, wrote);
    h.end(&first);
    h.advance(7_000);
    let left = h.tick();
    let second = left
        .into_iter()
        .find_map(|(id, step)| match step {
            Step::Go(sent) if id == 2 => Some(sent),
            _ => None,
        })
        .expect("the held request went when its wait was over");
    assert!(reserved(&second)[0] < 50, "{:?}", reserved(&second));
}
