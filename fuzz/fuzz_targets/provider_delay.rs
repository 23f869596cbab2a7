//! `retry_after::provider_delay` with arbitrary headers and body: a delay it returns is
//! positive and bounded, and what a client is told for it is never less than it (up to the
//! cap), in both header forms.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::classify::Dialect;
use llm_governor_core::config::Config;
use llm_governor_core::headers::Headers;
use llm_governor_core::ratelimit;
use llm_governor_core::retry_after::{self, Source};
use llm_governor_core::time::MAX_PARSED_MS;
use llm_governor_fuzz::{Fixed, Http};

fuzz_target!(|data: &[u8]| {
    let input = Http::parse(data);
    let h = Headers::new(&input.headers);
    let now = input.now_ms();
    let dialect = input
        .pseudo(":dialect")
        .and_then(Dialect::parse)
        .unwrap_or(Dialect::Auto);
    let snap = ratelimit::parse(&h, &|| now);
    let delay = retry_after::provider_delay(&h, input.body, &snap, dialect, now);
    if let Some(sub) = retry_after::sub_second_wait(&h, &snap) {
        assert!((1..1000).contains(&sub), "sub-second wait {sub}");
    }
    let Some((ms, source)) = delay else {
        return;
    };
    assert!(ms > 0, "zero delay from {source:?}");
    assert!(ms <= MAX_PARSED_MS, "{ms} from {source:?}");
    match source {
        Source::RetryAfterMs => assert!(h.contains("retry-after-ms")),
        Source::RetryAfter => assert!(h.contains("retry-after")),
        Source::ResetHeader(d) => assert_eq!(snap.window(d).reset_ms, Some(ms)),
        Source::GeminiRetryInfo => {
            assert!(llm_governor_core::classify::gemini_retry_delay(input.body).is_some())
        }
    }
    let mut cfg = Config::default().retry_after;
    cfg.max_ms = input.pseudo_u64(":max_ms", cfg.max_ms).max(1);
    cfg.jitter = (input.pseudo_u64(":jitter", 20) % 101) as f64 / 100.0;
    let told = retry_after::told(ms, ms, &cfg, &mut Fixed(input.unit()));
    assert!(
        told >= ms.min(cfg.max_ms) && told <= cfg.max_ms.max(1),
        "told {told} for {ms}"
    );
    let (ms_header, secs_header) = retry_after::header_values(told);
    assert_eq!(ms_header.parse::<u64>().ok(), Some(told));
    let secs: u64 = secs_header.parse().unwrap_or(0);
    assert!(secs.saturating_mul(1000) >= told, "{secs} s < {told} ms");
});
