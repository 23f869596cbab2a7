//! Properties of how usage is read from a response body, checked on generated bodies in the
//! shapes providers send (proptest): (d) the total does not depend on how the body is chunked.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::props::config;
use llm_governor_core::usage::UsageScanner;
use proptest::prelude::*;

/// A response body in one of the shapes providers send, with the total a scanner must read.
fn usage_body() -> impl Strategy<Value = (Vec<u8>, u64)> {
    let n = || prop_oneof![4 => 0..=100_000u64, 1 => 0..=u64::from(u32::MAX), 1 => Just(u64::MAX)];
    // JSON-escaped model text, sometimes quoting usage-like JSON itself.
    let text = prop_oneof![
        3 => "[a-zA-Z0-9 .,:;{}()\\[\\]-]{0,60}",
        1 => Just(r#"{\"total_tokens\": 5, \"input_tokens\":9}"#.to_string()),
        1 => Just(r#"usage \"promptTokenCount\":\n 12"#.to_string()),
    ];
    let sep = prop::sample::select(vec![":", ": ", " : ", ":\n  "]);
    prop_oneof![
        // OpenAI chat completion.
        (n(), n(), n(), n(), text.clone(), sep.clone()).prop_map(|(p, c, t, k, text, s)| {
            let b = format!(
                r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens"{s}{p},"completion_tokens"{s}{c},"total_tokens"{s}{t},"prompt_tokens_details":{{"cached_tokens":{k}}}}}}}"#
            );
            (b.into_bytes(), t)
        }),
        // OpenAI stream: deltas, then the usage chunk.
        (prop::collection::vec(text.clone(), 0..6), n(), n(), n(), sep.clone()).prop_map(
            |(deltas, p, c, t, s)| {
                let mut b = String::new();
                for d in deltas {
                    b += &format!(
                        "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"delta\":{{\"content\":\"{d}\"}}}}],\"usage\":null}}\n\n"
                    );
                }
                b += &format!(
                    "data: {{\"id\":\"c\",\"choices\":[],\"usage\":{{\"prompt_tokens\"{s}{p},\"completion_tokens\"{s}{c},\"total_tokens\"{s}{t}}}}}\n\ndata: [DONE]\n\n"
                );
                (b.into_bytes(), t)
            }
        ),
        // Anthropic message: input, cache writes and output (cache reads do not count).
        (n(), n(), n(), n(), text.clone(), sep.clone()).prop_map(|(i, w, r, o, text, s)| {
            let b = format!(
                r#"{{"id":"msg_1","type":"message","role":"assistant","content":[{{"type":"text","text":"{text}"}}],"usage":{{"input_tokens"{s}{i},"cache_creation_input_tokens"{s}{w},"cache_read_input_tokens"{s}{r},"output_tokens"{s}{o}}}}}"#
            );
            (b.into_bytes(), i.saturating_add(o).saturating_add(w))
        }),
        // Anthropic stream: message_start, deltas, message_delta with the final output count.
        (n(), n(), prop::collection::vec(text.clone(), 0..6), n(), sep.clone()).prop_map(
            |(i, first_out, deltas, o, s)| {
                let mut b = format!(
                    "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"msg_1\",\"usage\":{{\"input_tokens\"{s}{i},\"output_tokens\"{s}{first_out}}}}}}}\n\n"
                );
                for d in deltas {
                    b += &format!(
                        "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"delta\":{{\"type\":\"text_delta\",\"text\":\"{d}\"}}}}\n\n"
                    );
                }
                b += &format!(
                    "event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\"}},\"usage\":{{\"output_tokens\"{s}{o}}}}}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
                );
                (b.into_bytes(), i.saturating_add(o))
            }
        ),
        // Gemini, whole or streamed with running totals (the last one counts).
        (prop::collection::vec((n(), n(), n(), text), 1..5), sep).prop_map(|(chunks, s)| {
            let mut b = String::new();
            let mut last = 0;
            for (p, c, t, text) in chunks {
                b += &format!(
                    "data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"{text}\"}}],\"role\":\"model\"}}}}],\"usageMetadata\":{{\"promptTokenCount\"{s}{p},\"candidatesTokenCount\"{s}{c},\"totalTokenCount\"{s}{t}}}}}\r\n\r\n"
                );
                last = t;
            }
            (b.into_bytes(), last)
        }),
    ]
}

proptest! {
    #![proptest_config(config(384))]

    /// (d) The usage total does not depend on how the body is chunked, and is the one the
    /// provider reported.
    #[test]
    fn usage_total_does_not_depend_on_chunking(
        (body, total) in usage_body(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(body.len() + 1)).collect();
        at.sort_unstable();
        let mut scanner = UsageScanner::new();
        let mut from = 0;
        for to in at.iter().copied().chain([body.len()]) {
            scanner.feed(&body[from..to]);
            from = to;
        }
        let mut whole = UsageScanner::new();
        whole.feed(&body);
        prop_assert_eq!(whole.total(), Some(total), "whole body");
        prop_assert_eq!(scanner.total(), Some(total), "cut at {:?}", at);
    }
}
