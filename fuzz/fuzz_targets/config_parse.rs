//! `config::parse` on arbitrary bytes: an error naming a field, or a config that keeps the
//! validated invariants and builds a `Governor`. Never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::config::{self, DEFAULT_POOL};
use llm_governor_core::policy::Governor;

fuzz_target!(|data: &[u8]| {
    match config::parse(data) {
        Ok(cfg) => {
            let ra = cfg.retry_after;
            assert!(ra.default_ms >= 1 && ra.default_ms <= ra.max_ms, "{ra:?}");
            assert!((0.0..=1.0).contains(&ra.jitter), "{ra:?}");
            assert_eq!(
                cfg.pools.last().map(|p| p.name.as_str()),
                Some(DEFAULT_POOL)
            );
            for (i, l) in cfg.limits.iter().enumerate() {
                assert!(l.per_window > 0 && l.burst > 0, "{l:?}");
                assert!(cfg.limits[..i].iter().all(|o| o.name != l.name), "{l:?}");
            }
            assert!(cfg.max_keys >= 1);
            let _ = Governor::new(cfg, llm_governor_core::keys::HashKey::from_words(1, 2));
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
