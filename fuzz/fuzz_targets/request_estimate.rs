//! `estimate::estimate` on arbitrary bodies: never panics, never loops, and what it returns is
//! sane: a truncated read never estimates fewer tokens than the same body whole would from its
//! length alone, the output limit is capped, the reservation saturates instead of wrapping, and
//! the model it names is a range inside the body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llm_governor_core::estimate::{estimate, MAX_OUTPUT};

fuzz_target!(|body: &[u8]| {
    let whole = estimate(body, body.len());
    assert!(whole.max_output.is_none_or(|m| m <= MAX_OUTPUT));
    assert!(whole.reservation(u64::MAX) == u64::MAX || whole.max_output.is_some());
    assert!(whole.model.is_none_or(|(from, to)| from <= to && to <= body.len()));
    // Read only a prefix, as the host does past its bound: the rest is counted by length.
    let cut = body.len() / 2;
    let part = estimate(&body[..cut], body.len());
    assert!(part.input >= (body.len() - cut) as u64 / 4);
});
