//! `deadline::hold_budget_ms` with arbitrary header values: never above `hold.max_ms`, never
//! past the client's own (shortest stated) timeout less the margin, 0 when holding is off.
//! `:max_ms`, `:max_held` and `:margin_ms` set the config (bounded as `config::parse` bounds
//! them), `:deadline` a comma-separated list of deadline header names.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::config::Config;
use llm_governor_core::deadline;
use llm_governor_core::headers::Headers;
use llm_governor_fuzz::Http;

fuzz_target!(|data: &[u8]| {
    let input = Http::parse(data);
    let mut cfg = Config::default().hold;
    cfg.max_ms = input.pseudo_u64(":max_ms", cfg.max_ms) % 300_001;
    cfg.max_held = input.pseudo_u64(":max_held", cfg.max_held) % 100_001;
    cfg.margin_ms = input.pseudo_u64(":margin_ms", cfg.margin_ms) % 300_001;
    if let Some(names) = input.pseudo(":deadline") {
        cfg.deadline_headers = names
            .split(',')
            .map(|n| n.trim().to_ascii_lowercase())
            .collect();
    }
    let h = Headers::new(&input.headers);
    let budget = deadline::hold_budget_ms(&cfg, 0, &h);
    assert!(budget <= cfg.max_ms, "{budget} > max_ms {}", cfg.max_ms);
    if !cfg.enabled() {
        assert_eq!(budget, 0);
        return;
    }
    match deadline::client_timeout_ms(&cfg, &h) {
        Some(t) => assert!(
            budget <= t.saturating_sub(cfg.margin_ms),
            "{budget} past {t}"
        ),
        None => assert_eq!(budget, cfg.max_ms),
    }
});
