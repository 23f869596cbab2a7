//! What the tests send and what providers answer, written once: the chat path, two accounts'
//! credentials, the error bodies of a rate limit and of an exhausted quota, and a success body
//! that reports usage as each provider does.

use llm_governor_core::classify::Dialect;

/// OpenAI's chat completions path: the path most tests send to.
pub const PATH: &str = "/v1/chat/completions";

/// Account A's credential.
pub const A: (&str, &str) = ("authorization", "Bearer sk-a");
/// Account B's credential.
pub const B: (&str, &str) = ("authorization", "Bearer sk-b");

/// An OpenAI rate-limit error body.
pub const RL: &str = r#"{"error":{"type":"requests","code":"rate_limit_exceeded","message":"x"}}"#;
/// An OpenAI exhausted-quota error body.
pub const QUOTA: &str =
    r#"{"error":{"type":"insufficient_quota","code":"insufficient_quota","message":"x"}}"#;

/// A success body reporting `tokens` used, as the provider behind `dialect` reports it:
/// Anthropic counts input and output, the others (OpenAI's shape) a total too.
pub fn usage_body(dialect: Dialect, tokens: u64) -> String {
    let input = tokens / 2;
    let output = tokens - input;
    match dialect {
        Dialect::Anthropic => {
            format!(r#"{{"usage":{{"input_tokens":{input},"output_tokens":{output}}}}}"#)
        }
        _ => format!(
            r#"{{"usage":{{"prompt_tokens":{input},"completion_tokens":{output},"total_tokens":{tokens}}}}}"#
        ),
    }
}
