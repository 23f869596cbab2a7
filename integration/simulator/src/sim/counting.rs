//! How a request counts: the usage its answer reports, what the scenario's `tpm` counts it as,
//! and each key's token bucket. `tpm` counts the way OpenAI documents its TPM limit: the
//! estimated input plus the output limit, taken from the key's bucket at admission. Anthropic's
//! input and output tokens per minute (with its prompt cache) and OpenAI's per-day limits are
//! `meters` and `prompt_cache`; the usage they count is made here.

use std::collections::HashMap;
use std::time::Instant;

use super::ReqInfo;
use crate::decision::{Reason, TokenUse};
use crate::scenario::Usage;
use crate::tpm::{Bucket, Level, Take};

/// Completion tokens reported when the scenario does not say (less if the request's output
/// limit is lower).
pub const DEFAULT_OUTPUT_TOKENS: u64 = 5;

/// A request's tokens: the usage its answer reports, and its `tpm` count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTokens {
    pub input: u64,
    pub output: u64,
    /// Estimated input + the output limit (or the completion the simulator will report). The
    /// scenario's usage does not change it: the estimate is the provider's.
    pub counted: u64,
}

impl RequestTokens {
    /// `draw` gives a uniform number in [0, n) (the scenario's `output_tokens_range`).
    pub fn of(
        req: &ReqInfo,
        usage: Option<&Usage>,
        draw: &mut dyn FnMut(u64) -> u64,
    ) -> RequestTokens {
        let input = usage
            .and_then(|u| u.input_tokens)
            .unwrap_or(req.est_input_tokens);
        let ranged = usage
            .and_then(|u| u.output_tokens_range)
            .map(|(lo, hi)| lo + draw(hi - lo + 1));
        let output = usage.and_then(|u| u.output_tokens).or(ranged).unwrap_or(
            req.max_output_tokens
                .map_or(DEFAULT_OUTPUT_TOKENS, |m| m.min(DEFAULT_OUTPUT_TOKENS)),
        );
        let counted = req
            .est_input_tokens
            .saturating_add(req.max_output_tokens.unwrap_or(output));
        RequestTokens {
            input,
            output,
            counted,
        }
    }
}

/// What a key's bucket made of a request's count, before anything is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenCheck {
    pub usage: TokenUse,
    pub take: Take,
}

/// Each key's `tpm` bucket.
#[derive(Default)]
pub struct TokenBuckets(HashMap<String, Bucket>);

impl TokenBuckets {
    /// Whether `counted` tokens fit in `key`'s bucket (a new key's starts full). Charges nothing.
    pub fn check(&mut self, key: &str, capacity: u64, counted: u64, now: Instant) -> TokenCheck {
        let bucket = self
            .0
            .entry(key.to_string())
            .or_insert_with(|| Bucket::full(capacity, now));
        let used = bucket.level(capacity, now).used;
        TokenCheck {
            usage: TokenUse {
                limit: capacity,
                counted,
                used,
            },
            take: bucket.check(capacity, now, counted),
        }
    }

    /// The bucket as the answer reports it: after the charge of a served request.
    pub fn settle(
        &mut self,
        key: &str,
        check: &TokenCheck,
        served: bool,
        now: Instant,
    ) -> Option<Level> {
        let TokenUse { limit, counted, .. } = check.usage;
        let b = self.0.get_mut(key)?;
        if served {
            b.charge(limit, now, counted);
        }
        Some(b.level(limit, now))
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

/// When a request the tokens rejected would fit, in ms.
pub fn token_wait(reason: Reason, check: Option<TokenCheck>, bucket: Option<Level>) -> Option<u64> {
    match (reason, check.map(|c| c.take)) {
        (Reason::TokensExhausted, Some(Take::Wait { wait_ms })) => Some(wait_ms),
        // Never fits: the time until the bucket is full is all there is to say.
        (Reason::TokensTooLarge, _) => bucket.map(|b| b.reset_ms.max(1)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant, SystemTime};

    use super::*;
    use crate::decision::Outcome;
    use crate::dialect::Dialect;
    use crate::scenario::Dimension;
    use crate::sim::testing::{info, scenario};
    use crate::sim::State;

    /// A request counted 1,000 tokens: 10 estimated input + `max_tokens` 990.
    fn thousand(key: &str) -> ReqInfo<'_> {
        let mut i = info(key);
        i.max_output_tokens = Some(990);
        i
    }

    /// The last log entry as (decision, status, hint_ms, counted_tokens, tokens_remaining).
    fn last_tokens(st: &State) -> (String, u64, Option<u64>, Option<u64>, Option<u64>) {
        let doc = st.requests_json();
        let e = doc["requests"].as_array().unwrap().last().unwrap().clone();
        (
            e["decision"].as_str().unwrap().to_string(),
            e["status"].as_u64().unwrap(),
            e["hint_ms"].as_u64(),
            e["counted_tokens"].as_u64(),
            e["tokens_remaining"].as_u64(),
        )
    }

    #[test]
    fn tpm_admits_what_fits_and_does_not_charge_rejections() {
        let mut st = State::new(scenario(r#"{"tpm":{"tokens":20000}}"#));
        let t0 = Instant::now();
        let sys = SystemTime::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        for n in 1..=20u64 {
            let d = st.decide(&thousand("k"), t0, sys);
            assert_eq!((d.status, d.reason), (200, Reason::Ok), "request {n}");
            assert_eq!(d.limits.limit_tokens, 20000);
            assert_eq!(d.limits.remaining_tokens, 20000 - 1000 * n);
            // Until full again: the tokens in use at 1/3 token per ms.
            assert_eq!(d.limits.reset_tokens_ms, 3 * 1000 * n);
        }
        // The 21st does not fit: 1,000 more tokens take 3 s. It is not charged, so a second
        // one 1.5 s later waits 1.5 s, not 4.5 s.
        let d = st.decide(&thousand("k"), t0, sys);
        assert_eq!((d.status, d.reason), (429, Reason::TokensExhausted));
        assert_eq!(d.outcome, Outcome::RateLimited);
        assert_eq!(d.exhausted, Some(Dimension::Tokens));
        assert_eq!(d.hint_ms, 3000);
        assert!(!d.in_flight);
        assert_eq!(
            d.tokens,
            Some(TokenUse {
                limit: 20000,
                counted: 1000,
                used: 20000
            })
        );
        // The real bucket, not a zeroed dimension with the hint as its reset.
        assert_eq!(
            (d.limits.remaining_tokens, d.limits.reset_tokens_ms),
            (0, 60000)
        );
        assert_eq!(
            last_tokens(&st),
            (
                "tokens_exhausted".into(),
                429,
                Some(3000),
                Some(1000),
                Some(0)
            )
        );
        let d = st.decide(&thousand("k"), at(1500), sys);
        assert_eq!((d.reason, d.hint_ms), (Reason::TokensExhausted, 1500));
        assert_eq!(
            (d.limits.remaining_tokens, d.limits.reset_tokens_ms),
            (500, 58500)
        );
        // At 3 s it fits, and takes the bucket back to empty.
        let d = st.decide(&thousand("k"), at(3000), sys);
        assert_eq!(d.reason, Reason::Ok);
        assert_eq!(
            last_tokens(&st),
            ("ok".into(), 200, None, Some(1000), Some(0))
        );
        // Each key has its own bucket; a new scenario starts every bucket full.
        assert_eq!(
            st.decide(&thousand("other"), at(3000), sys).reason,
            Reason::Ok
        );
        st.set_scenario(scenario(r#"{"tpm":{"tokens":20000}}"#));
        let d = st.decide(&thousand("k"), Instant::now(), sys);
        assert_eq!((d.reason, d.limits.remaining_tokens), (Reason::Ok, 19000));
        // Without tpm nothing is counted.
        st.set_scenario(scenario("{}"));
        st.decide(&thousand("k"), Instant::now(), sys);
        assert_eq!(last_tokens(&st), ("ok".into(), 200, None, None, None));
    }

    #[test]
    fn tpm_counts_the_output_limit_or_the_completion() {
        let now = Instant::now();
        let sys = SystemTime::now();
        // (scenario, max_output_tokens, counted, completion reported)
        let rows: [(&str, Option<u64>, u64, u64); 5] = [
            // No output limit: the completion the simulator reports (5).
            (
                r#"{"tpm":{"tokens":20000}}"#,
                None,
                10 + DEFAULT_OUTPUT_TOKENS,
                5,
            ),
            // With one: all of it counts; the completion is at most the limit.
            (r#"{"tpm":{"tokens":20000}}"#, Some(200), 210, 5),
            (r#"{"tpm":{"tokens":20000}}"#, Some(3), 13, 3),
            (r#"{"tpm":{"tokens":20000}}"#, Some(0), 10, 0),
            // The scenario's usage sets the completion; the count still uses the limit.
            (
                r#"{"tpm":{"tokens":20000},"usage":{"input_tokens":7,"output_tokens":300}}"#,
                Some(200),
                210,
                300,
            ),
        ];
        for (sc, max, counted, completion) in rows {
            let mut st = State::new(scenario(sc));
            let mut i = info("k");
            i.max_output_tokens = max;
            let d = st.decide(&i, now, sys);
            assert_eq!(d.tokens.map(|t| t.counted), Some(counted), "{sc} {max:?}");
            assert_eq!(d.output_tokens, completion, "{sc} {max:?}");
            assert_eq!(d.limits.remaining_tokens, 20000 - counted, "{sc} {max:?}");
        }
        // The usage's prompt tokens do not change the count: the estimate is the provider's.
        let mut st = State::new(scenario(
            r#"{"tpm":{"tokens":100},"usage":{"input_tokens":7}}"#,
        ));
        let d = st.decide(&info("k"), now, sys);
        assert_eq!((d.input_tokens, d.tokens.map(|t| t.counted)), (7, Some(15)));
    }

    #[test]
    fn tpm_too_large_never_fits_and_is_not_charged() {
        let mut st = State::new(scenario(r#"{"tpm":{"tokens":20000}}"#));
        let now = Instant::now();
        let sys = SystemTime::now();
        for max in [19_991, u64::MAX] {
            let mut i = info("k");
            i.max_output_tokens = Some(max);
            let d = st.decide(&i, now, sys);
            assert_eq!((d.status, d.reason), (429, Reason::TokensTooLarge), "{max}");
            assert_eq!(d.tokens.map(|t| t.counted), Some(10u64.saturating_add(max)));
            assert_eq!(d.limits.remaining_tokens, 20000);
            // No retry header (it never fits); the log reads the reset header, which is 0.
            assert_eq!(last_tokens(&st).2, Some(0));
        }
        // Exactly the capacity fits.
        let mut i = info("k");
        i.max_output_tokens = Some(19_990);
        assert_eq!(st.decide(&i, now, sys).reason, Reason::Ok);
    }

    #[test]
    fn tpm_follows_targeting_and_precedence() {
        let now = Instant::now();
        let sys = SystemTime::now();
        // Only the listed keys have a bucket; rejections use `count`.
        let mut st = State::new(scenario(
            r#"{"tpm":{"tokens":1000},"keys":["a"],"count":1}"#,
        ));
        assert_eq!(st.decide(&thousand("b"), now, sys).tokens, None);
        assert_eq!(st.decide(&thousand("b"), now, sys).reason, Reason::Ok);
        assert_eq!(st.decide(&thousand("a"), now, sys).reason, Reason::Ok);
        assert_eq!(
            st.decide(&thousand("a"), now, sys).reason,
            Reason::TokensExhausted
        );
        // `count` used up: no longer targeted, served and not counted.
        let d = st.decide(&thousand("a"), now, sys);
        assert_eq!((d.reason, d.tokens), (Reason::Ok, None));

        // A full window wins, and its rejection is not charged.
        st.set_scenario(scenario(
            r#"{"tpm":{"tokens":2000},"limit":{"requests":1,"window_ms":60000}}"#,
        ));
        assert_eq!(st.decide(&thousand("c"), now, sys).reason, Reason::Ok);
        let w = st.decide(&thousand("c"), now, sys);
        assert_eq!(
            (w.reason, w.limits.remaining_tokens),
            (Reason::WindowFull, 1000)
        );

        // Tokens come before concurrency, and a concurrency rejection is not charged either.
        st.set_scenario(scenario(r#"{"tpm":{"tokens":3000},"max_concurrency":1}"#));
        assert_eq!(st.decide(&thousand("d"), now, sys).reason, Reason::Ok);
        let c = st.decide(&thousand("d"), now, sys);
        assert_eq!(
            (c.reason, c.limits.remaining_tokens),
            (Reason::Concurrency, 2000)
        );
        st.finish("d");
        assert_eq!(st.decide(&thousand("d"), now, sys).reason, Reason::Ok);
        st.finish("d");
        assert_eq!(st.decide(&thousand("d"), now, sys).reason, Reason::Ok);
        st.finish("d");
        assert_eq!(
            st.decide(&thousand("d"), now, sys).reason,
            Reason::TokensExhausted
        );

        // The mode answers before the bucket is looked at.
        st.set_scenario(scenario(r#"{"tpm":{"tokens":3000},"mode":"quota"}"#));
        let q = st.decide(&thousand("e"), now, sys);
        assert_eq!((q.reason, q.limits.remaining_tokens), (Reason::Mode, 3000));

        // Other dialects get their own rate-limit shape (Gemini: the per-minute one).
        st.set_scenario(scenario(r#"{"tpm":{"tokens":1000}}"#));
        let mut g = thousand("f");
        g.dialect = Dialect::Gemini;
        st.decide(&g, now, sys);
        let d = st.decide(&g, now, sys);
        assert_eq!(
            (d.reason, d.outcome),
            (Reason::TokensExhausted, Outcome::GeminiMinute)
        );
        let mut a = thousand("g");
        a.dialect = Dialect::Anthropic;
        st.decide(&a, now, sys);
        let d = st.decide(&a, now, sys);
        assert_eq!((d.reason, d.status), (Reason::TokensExhausted, 429));
        // Anthropic's default style: `retry-after` in whole seconds (60 s here).
        assert_eq!(last_tokens(&st).2, Some(60000));
    }
}
