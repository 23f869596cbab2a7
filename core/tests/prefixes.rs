//! Prompt prefixes up to `cache_control` breakpoints (issue 32): the same prompt gives the same
//! keyed hashes whatever the rest of the body says; a conversation's next turn finds its last
//! breakpoint among its candidates; bad input is estimated, never a panic, and no content is
//! kept.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use llm_governor_core::estimate::{self, MAX_BODY};
use llm_governor_core::keys::HashKey;
use llm_governor_core::prefix::{scan, Prompt, FIVE_MINUTES_MS, LOOKBACK, ONE_HOUR_MS};

fn key() -> HashKey {
    HashKey::from_words(3, 5)
}

fn prompt(body: &str) -> Option<Prompt> {
    let est = estimate::estimate(body.as_bytes(), body.len());
    scan(body.as_bytes(), est.input, &key())
}

const SYSTEM: &str = r#"[{"type": "text", "text": "You are a careful coding agent. Read before you write.", "cache_control": {"type": "ephemeral"}}]"#;

#[test]
fn the_same_prefix_hashes_alike_whatever_else_the_body_says() {
    // Key order, max_tokens, stream and the model's spelling are not part of the prompt.
    let a = prompt(&format!(
        r#"{{"model": "claude-sonnet-4-5", "max_tokens": 16000, "system": {SYSTEM}, "messages": [{{"role": "user", "content": "one"}}]}}"#
    ))
    .unwrap();
    let b = prompt(&format!(
        r#"{{"messages": [{{"role": "user", "content": "two"}}], "stream": true, "system": {SYSTEM}, "max_tokens": 10}}"#
    ))
    .unwrap();
    assert_eq!(a.breakpoints, b.breakpoints);
    assert_eq!(a.breakpoints[0].ttl_ms, FIVE_MINUTES_MS);
    // Another key: other hashes (a client cannot aim at another's prefix).
    let body = format!(r#"{{"system": {SYSTEM}, "messages": []}}"#);
    let other = scan(body.as_bytes(), 100, &HashKey::from_words(4, 5)).unwrap();
    assert_ne!(other.breakpoints, a.breakpoints);
    // A different system prompt, or the same one with tools before it: another prefix.
    let c = prompt(&format!(
        r#"{{"system": {}, "messages": []}}"#,
        SYSTEM.replace("careful", "careless")
    ))
    .unwrap();
    assert_ne!(c.breakpoints, a.breakpoints);
    let d = prompt(&format!(
        r#"{{"tools": [{{"name": "read", "input_schema": {{"type": "object"}}}}], "system": {SYSTEM}, "messages": []}}"#
    ))
    .unwrap();
    assert_ne!(d.breakpoints, a.breakpoints);
}

/// A turn as the SDK sends it: the breakpoint on the newest block only.
fn turn(n: usize) -> String {
    let messages: Vec<String> = (0..n)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let cc = if i + 1 == n {
                r#", "cache_control": {"type": "ephemeral", "ttl": "1h"}"#
            } else {
                ""
            };
            format!(r#"{{"role": "{role}", "content": [{{"type": "text", "text": "message {i}"{cc}}}]}}"#)
        })
        .collect();
    format!(
        r#"{{"system": {SYSTEM}, "messages": [{}], "max_tokens": 64}}"#,
        messages.join(", ")
    )
}

#[test]
fn the_next_turn_finds_the_last_breakpoint_of_the_one_before() {
    let first = prompt(&turn(1)).unwrap();
    let third = prompt(&turn(3)).unwrap();
    assert_eq!(first.breakpoints.len(), 2); // system, and the last message
    assert_eq!(first.breakpoints[1].ttl_ms, ONE_HOUR_MS);
    // The first turn's last breakpoint is a candidate of the third (its cache_control moved).
    let at = third
        .candidates
        .iter()
        .position(|c| c.hash == first.breakpoints[1].hash)
        .unwrap();
    // Longest first: the third turn's own breakpoint, then the message before, then this one.
    assert_eq!(at, 2);
    assert_eq!(third.candidates[0].hash, third.breakpoints[1].hash);
    // What is left to count after each candidate shrinks as the prefix grows.
    let left: Vec<u64> = third.candidates.iter().map(|c| c.uncached).collect();
    assert!(left.windows(2).all(|w| w[0] <= w[1]), "{left:?}");
    // The system prompt's estimate is what a hit there saves.
    let whole = estimate::estimate(turn(3).as_bytes(), turn(3).len()).input;
    let system = third.candidates.last().unwrap();
    assert!(whole - system.uncached >= 10, "{whole} {system:?}");
}

#[test]
fn candidates_look_back_as_far_as_the_provider() {
    let p = prompt(&turn(60)).unwrap();
    // The last message's breakpoint and the 20 boundaries before it, and the system's.
    assert_eq!(p.candidates.len(), LOOKBACK + 1 + 1);
}

/// Bad input: estimated or ignored, never a panic, bounded.
#[test]
fn bad_input_is_estimated_never_refused() {
    let rows: [(&str, String, usize); 12] = [
        ("not json", "cache_control garbage {{{".to_string(), 0),
        ("no breakpoint", r#"{"system": "x", "messages": []}"#.to_string(), 0),
        ("null cache_control", r#"{"system": [{"type": "text", "text": "x", "cache_control": null}]}"#.to_string(), 0),
        ("top level", r#"{"cache_control": {"type": "ephemeral"}, "messages": [{"role": "user", "content": "x"}]}"#.to_string(), 0),
        ("inside a schema", r#"{"tools": [{"name": "t", "input_schema": {"properties": {"cache_control": {"type": "object"}}}}]}"#.to_string(), 0),
        ("unknown block type", r#"{"messages": [{"role": "user", "content": [{"type": "hologram", "data": 7, "cache_control": {"type": "ephemeral"}}]}]}"#.to_string(), 1),
        ("unknown ttl", r#"{"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]}"#.to_string(), 1),
        ("on a message", r#"{"messages": [{"role": "user", "content": "x", "cache_control": {"type": "ephemeral"}}]}"#.to_string(), 1),
        ("string system", r#"{"system": "plain", "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]}"#.to_string(), 1),
        ("many breakpoints", format!(r#"{{"tools": [{}]}}"#, vec![r#"{"name": "t", "cache_control": {"type": "ephemeral"}}"#; 50].join(",")), 8),
        ("unbalanced", r#"{"system": [{"type": "text", "cache_control": {"type": "ephemeral"}]]]}"#.to_string(), 0),
        ("deep", format!(r#"{{"system": [{{"type": "text", "x": {}1{}, "cache_control": {{"type": "ephemeral"}}}}]}}"#, "[".repeat(100_000), "]".repeat(100_000)), 1),
    ];
    for (name, body, breakpoints) in rows {
        let p = prompt(&body);
        assert_eq!(p.map_or(0, |p| p.breakpoints.len()), breakpoints, "{name}");
    }
    let ttl = prompt(r#"{"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]}"#).unwrap();
    assert_eq!(
        ttl.breakpoints[0].ttl_ms, FIVE_MINUTES_MS,
        "an unknown ttl is the shorter"
    );
}

#[test]
fn a_prefix_past_the_read_limit_is_estimated() {
    // A 300 KB system block, its breakpoint past the 256 KiB the filter reads, and a
    // messages section before it in the body: nothing past the cut is hashed.
    let long = "word ".repeat(60_000);
    let body = format!(
        r#"{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "hi", "cache_control": {{"type": "ephemeral"}}}}]}}], "system": [{{"type": "text", "text": "{long}", "cache_control": {{"type": "ephemeral"}}}}]}}"#
    );
    assert!(body.len() > MAX_BODY);
    // The system section is cut: nothing after it in cache order (the messages) is known.
    assert_eq!(prompt(&body), None);
    // The messages cut with no tools seen yet: the tools may follow in the unread part (the
    // SDKs write them after the messages), and they come first in cache order.
    let messages = format!(
        r#""messages": [{{"role": "user", "content": [{{"type": "text", "text": "{long}", "cache_control": {{"type": "ephemeral"}}}}]}}]"#
    );
    let system =
        r#""system": [{"type": "text", "text": "short", "cache_control": {"type": "ephemeral"}}]"#;
    assert_eq!(prompt(&format!("{{{system}, {messages}}}")), None);
    // With the tools read and the cut section last in cache order, the boundaries before it
    // stand.
    let tools = r#""tools": [{"name": "t", "input_schema": {}}]"#;
    let p = prompt(&format!("{{{tools}, {system}, {messages}}}")).unwrap();
    assert_eq!(p.breakpoints.len(), 1);
}

#[test]
fn nothing_of_the_content_is_kept() {
    let secret = "the launch code is 0000";
    let p = prompt(&format!(
        r#"{{"system": [{{"type": "text", "text": "{secret}", "cache_control": {{"type": "ephemeral"}}}}]}}"#
    ))
    .unwrap();
    let shown = format!("{p:?}");
    assert!(!shown.contains("launch"), "{shown}");
}
