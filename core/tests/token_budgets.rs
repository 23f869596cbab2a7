//! Token budgets: usage read from real provider bodies and streams, charged after the
//! response, enforced on the next request.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::Decision;
use common::{header, Host};
use llm_governor_core::usage::UsageScanner;

const OPENAI_JSON: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1200,"completion_tokens":300,"total_tokens":1500,"prompt_tokens_details":{"cached_tokens":1024}}}"#;
const OPENAI_SSE: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\ndata: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"lo\"}}],\"usage\":null}\n\ndata: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":7,\"total_tokens\":27}}\n\ndata: [DONE]\n\n";
const ANTHROPIC_JSON: &str = r#"{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":40,"cache_creation_input_tokens":1000,"cache_read_input_tokens":5000,"output_tokens":12}}"#;
const ANTHROPIC_SSE: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
const GEMINI_JSON: &str = r#"{"candidates":[{"content":{"parts":[{"text":"hi"}],"role":"model"}}],"usageMetadata":{"promptTokenCount":8,"candidatesTokenCount":5,"totalTokenCount":13}}"#;

#[test]
fn usage_from_every_provider_shape_whatever_the_chunking() {
    for (name, body, total) in [
        ("openai json", OPENAI_JSON, 1500),
        ("openai sse", OPENAI_SSE, 27),
        (
            "anthropic json: input, cache writes and output",
            ANTHROPIC_JSON,
            1052,
        ),
        ("anthropic sse", ANTHROPIC_SSE, 40),
        ("gemini json", GEMINI_JSON, 13),
    ] {
        let bytes = body.as_bytes();
        for split in 0..=bytes.len() {
            let mut s = UsageScanner::new();
            s.feed(&bytes[..split]);
            s.feed(&bytes[split..]);
            assert_eq!(s.total(), Some(total), "{name} split at {split}");
        }
        // One byte at a time.
        let mut s = UsageScanner::new();
        for b in bytes {
            s.feed(std::slice::from_ref(b));
        }
        assert_eq!(s.total(), Some(total), "{name} byte by byte");
    }
}

#[test]
fn no_usage_no_charge() {
    let mut s = UsageScanner::new();
    s.feed(br#"{"choices":[],"usage":null}"#);
    s.feed(&[0xff; 100]);
    assert_eq!(s.total(), None);
}

const CFG: &str = r#"{"limits": [
  {"name": "tenant-tpm", "key": "header:x-tenant-id", "tokens_per_minute": 6000, "burst": 1000}
]}"#;

#[test]
fn budget_admits_while_tokens_are_left_and_charges_usage() {
    let mut host = Host::new(CFG);
    let t = [("x-tenant-id", "t1")];
    let flow = host.forward("/v1/chat/completions", &t);
    assert_eq!(flow.charges.len(), 1);
    // Usage above the bucket: the tenant goes into debt...
    host.end_with_usage(&flow, 1500);
    // ...and is refused until 501 tokens have refilled at 100 per second.
    match host.request("/v1/chat/completions", &t) {
        Decision::Reply(r) => {
            assert_eq!(header(&r.headers, "x-llm-governor-source"), "limit");
            assert_eq!(header(&r.headers, "retry-after-ms"), "5010");
            assert_eq!(
                header(&r.headers, "ratelimit-policy"),
                "\"tenant-tpm\";q=6000;w=60"
            );
        }
        Decision::Forward(_) => panic!("admitted while in debt"),
    }
    // Another tenant is unaffected.
    host.forward("/v1/chat/completions", &[("x-tenant-id", "t2")]);
    host.advance(5_010);
    host.forward("/v1/chat/completions", &t);
}

#[test]
fn overlapping_keys_read_the_same_whole_or_in_chunks() {
    // Found by fuzz/fuzz_targets/usage_chunks.rs: the closing quote of one key starts another.
    let body = b"16:20:10 : 0\n,,\"totalTokenCount\"totalTokenCount\":13555555555555555%5555555utput_detens\":1024}}}";
    let whole = {
        let mut s = llm_governor_core::usage::UsageScanner::new();
        s.feed(body);
        s.total()
    };
    let cut = {
        let mut s = llm_governor_core::usage::UsageScanner::new();
        s.feed(&body[..45]);
        s.feed(&body[45..]);
        s.feed(b"");
        s.total()
    };
    assert_eq!(whole, Some(13_555_555_555_555_555));
    assert_eq!(cut, whole);
}
