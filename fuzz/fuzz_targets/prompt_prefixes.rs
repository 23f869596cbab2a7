//! `prefix::scan` on arbitrary bodies: never panics, never loops, and what it returns is
//! bounded (at most `MAX_BREAKPOINTS` breakpoints, each with its `LOOKBACK` candidates, none
//! predicting more uncached input than the whole estimate); a well-formed body cut in half
//! (as the read limit cuts one) gives no breakpoint the whole body does not have. Malformed
//! bodies are only bounded: the provider answers them 400, whatever was predicted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::keys::HashKey;
use llm_governor_core::prefix::{scan, LOOKBACK, MAX_BREAKPOINTS};

fuzz_target!(|body: &[u8]| {
    let key = HashKey::from_words(7, 11);
    let whole = scan(body, 1_000, &key);
    if let Some(p) = &whole {
        assert!(!p.breakpoints.is_empty() && p.breakpoints.len() <= MAX_BREAKPOINTS);
        assert!(p.candidates.len() <= MAX_BREAKPOINTS * (LOOKBACK + 1));
        assert!(p.candidates.iter().all(|c| c.uncached <= 1_000));
    }
    if serde_json::from_slice::<serde_json::Value>(body).is_err() {
        let _ = scan(&body[..body.len() / 2], 1_000, &key);
        return;
    }
    let cut = scan(&body[..body.len() / 2], 1_000, &key);
    if let Some(part) = cut {
        let all = whole.map(|w| w.breakpoints).unwrap_or_default();
        assert!(part.breakpoints.iter().all(|b| all.contains(b)), "a cut body invented a breakpoint");
    }
});
