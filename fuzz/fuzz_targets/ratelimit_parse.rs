//! `ratelimit::parse` over headers built from the input (see `llm_governor_fuzz::Http`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::headers::Headers;
use llm_governor_core::ratelimit::{self, Dimension};
use llm_governor_core::time::MAX_PARSED_MS;
use llm_governor_fuzz::Http;

fuzz_target!(|data: &[u8]| {
    let input = Http::parse(data);
    let h = Headers::new(&input.headers);
    let snap = ratelimit::parse(&h, &|| input.now_ms());
    assert_eq!(
        snap,
        ratelimit::parse(&h, &|| input.now_ms()),
        "not deterministic"
    );
    for d in Dimension::ALL {
        let w = snap.window(d);
        if let Some(ms) = w.reset_ms {
            assert!(ms <= MAX_PARSED_MS, "{d:?} reset {ms}");
        }
    }
    for d in snap.exhausted() {
        assert_eq!(snap.window(d).remaining, Some(0), "{d:?}");
    }
    let longest = snap
        .exhausted()
        .filter_map(|d| snap.window(d).reset_ms)
        .max();
    assert_eq!(snap.exhausted_reset_ms(), longest);
    let _ = llm_governor_core::retry_after::exhausted_dimension(&snap, input.body);
});
