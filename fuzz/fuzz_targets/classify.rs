//! `classify::classify` with the status from the first two bytes (big endian) and the rest as
//! the error body, plus every body reader the delay computation uses.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::classify::{self, Class};

fuzz_target!(|data: &[u8]| {
    let Some((status, body)) = data.split_first_chunk::<2>() else {
        return;
    };
    let status = u16::from_be_bytes(*status);
    let class = classify::classify(status, body);
    // Only governed statuses classify, and only a 429 can be quota.
    assert_eq!(class.is_some(), classify::is_governed_status(status));
    if class == Some(Class::QuotaExhausted) {
        assert_eq!(status, 429);
    }
    if let Some(c) = class {
        assert_eq!(Class::from_byte(c.to_byte()), Some(c));
    }
    // An unreadable body (empty) never makes a quota answer.
    assert_ne!(classify::classify(status, &[]), Some(Class::QuotaExhausted));
    let _ = classify::gemini_retry_delay(body);
    let _ = classify::openai_error_dimension(body);
});
