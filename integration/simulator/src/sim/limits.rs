//! The rate-limit values an answer reports: the scenario's `ratelimit` overrides, else what the
//! window and the token bucket saw, else defaults; and the dimension a rejection reports
//! exhausted.

use crate::decision::{Limits, Outcome, Reason};
use crate::scenario::{Dimension, Scenario};
use crate::tpm::Level;

use super::counting::RequestTokens;
use super::window::WindowCount;

/// The limits as a request that exhausts nothing sees them.
pub fn resolve(
    sc: &Scenario,
    window: Option<WindowCount>,
    bucket: Option<Level>,
    tokens: &RequestTokens,
) -> Limits {
    let (input_tokens, output_tokens) = (tokens.input, tokens.output);
    let rl = sc.ratelimit.clone().unwrap_or_default();
    let limit_requests = rl
        .limit_requests
        .or(sc.limit.as_ref().map(|l| l.requests))
        .unwrap_or(60);
    let remaining_requests = rl
        .remaining_requests
        .or(sc
            .limit
            .as_ref()
            .zip(window)
            .map(|(l, w)| l.requests.saturating_sub(w.count)))
        .unwrap_or(limit_requests.saturating_sub(1));
    let reset_requests_ms = rl
        .reset_requests_ms
        .or(window.map(|w| w.oldest_ms))
        .unwrap_or(1000);
    let limit_tokens = rl
        .limit_tokens
        .or(sc.tpm.as_ref().map(|t| t.tokens))
        .unwrap_or(100_000);
    let reset_tokens_ms = rl
        .reset_tokens_ms
        .or(bucket.map(|b| b.reset_ms))
        .unwrap_or(6000);
    let limit_input_tokens = rl.limit_input_tokens.unwrap_or(80_000);
    let limit_output_tokens = rl.limit_output_tokens.unwrap_or(20_000);
    Limits {
        limit_requests,
        remaining_requests,
        reset_requests_ms,
        limit_tokens,
        remaining_tokens: rl
            .remaining_tokens
            .or(bucket.map(|b| b.remaining))
            .unwrap_or(limit_tokens.saturating_sub(input_tokens.saturating_add(output_tokens))),
        reset_tokens_ms,
        limit_input_tokens,
        remaining_input_tokens: rl
            .remaining_input_tokens
            .unwrap_or(limit_input_tokens.saturating_sub(input_tokens)),
        reset_input_tokens_ms: reset_tokens_ms,
        limit_output_tokens,
        remaining_output_tokens: rl
            .remaining_output_tokens
            .unwrap_or(limit_output_tokens.saturating_sub(output_tokens)),
        reset_output_tokens_ms: reset_tokens_ms,
    }
}

/// The dimension an answer reports exhausted, with `limits` changed to say so: nothing left
/// until the hint. A concurrency 429 exhausts no rate-limit dimension: the headers stay as they
/// are. A token 429 reports the tokens dimension with the bucket's own values.
pub fn exhaust(
    limits: &mut Limits,
    reason: Reason,
    outcome: Outcome,
    dimension: Option<Dimension>,
    hint_ms: u64,
) -> Option<Dimension> {
    let exhausted = match outcome {
        _ if reason == Reason::Concurrency => None,
        _ if matches!(
            reason,
            Reason::InputTokensExhausted | Reason::OutputTokensExhausted | Reason::DayExhausted
        ) =>
        {
            dimension
        }
        _ if matches!(reason, Reason::TokensExhausted | Reason::TokensTooLarge) => {
            Some(Dimension::Tokens)
        }
        Outcome::RateLimited | Outcome::GeminiMinute => Some(dimension.unwrap_or_default()),
        _ => None,
    };
    match exhausted {
        Some(Dimension::Tokens)
            if matches!(reason, Reason::TokensExhausted | Reason::TokensTooLarge) => {}
        Some(Dimension::Requests) => {
            limits.remaining_requests = 0;
            limits.reset_requests_ms = hint_ms;
        }
        Some(Dimension::Tokens) => {
            limits.remaining_tokens = 0;
            limits.reset_tokens_ms = hint_ms;
        }
        Some(Dimension::InputTokens) => {
            limits.remaining_input_tokens = 0;
            limits.reset_input_tokens_ms = hint_ms;
        }
        Some(Dimension::OutputTokens) => {
            limits.remaining_output_tokens = 0;
            limits.reset_output_tokens_ms = hint_ms;
        }
        None => {}
    }
    exhausted
}

#[cfg(test)]
mod tests {
    use std::time::{Instant, SystemTime};

    use crate::decision::Outcome;
    use crate::dialect::Dialect;
    use crate::scenario::{Dimension, Mode};
    use crate::sim::testing::{info, scenario};
    use crate::sim::State;

    #[test]
    fn dimension_and_overrides() {
        let mut st = State::new(scenario(
            r#"{"mode":"rate_limited","dimension":"tokens","retry_after_s":2.5,
                "ratelimit":{"limit_tokens":30000,"remaining_requests":7}}"#,
        ));
        let d = st.decide(&info("a"), Instant::now(), SystemTime::now());
        assert_eq!(d.hint_ms, 2500);
        assert_eq!(d.exhausted, Some(Dimension::Tokens));
        assert_eq!(d.limits.remaining_tokens, 0);
        assert_eq!(d.limits.reset_tokens_ms, 2500);
        assert_eq!(d.limits.remaining_requests, 7);
        assert_eq!(d.limits.limit_tokens, 30000);

        st.set_scenario(scenario(r#"{"mode":"quota"}"#));
        let mut g = info("a");
        g.dialect = Dialect::Gemini;
        assert_eq!(
            st.decide(&g, Instant::now(), SystemTime::now()).outcome,
            Outcome::GeminiDay
        );
        st.reset();
        assert_eq!(st.requests_json()["total"], 0);
        assert_eq!(st.scenario().mode, Mode::Ok);
    }
}
