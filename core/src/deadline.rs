//! How long the gateway may hold a request: `min(its class's max_ms, client timeout - margin)`
//! (without classes, `hold.max_ms`).
//!
//! The client's timeout comes from the first of `hold.deadline_headers` that carries a
//! well-formed value. The official SDKs send `x-stainless-read-timeout` / `x-stainless-timeout`
//! in seconds (`600`, `12.5`); header names ending in `-ms` are milliseconds. Malformed values
//! (negative, NaN, exponents, non-UTF-8) are skipped; a header sent several times counts with
//! its shortest value, so a client is never held past the shorter of its timeouts.

use crate::config::Hold;
use crate::headers::Headers;
use crate::time;

/// The client's timeout in ms, if any header states one.
pub fn client_timeout_ms(cfg: &Hold, h: &Headers) -> Option<u64> {
    cfg.deadline_headers.iter().find_map(|name| {
        // Most requests carry none of them: one cheap lookup each before reading every value.
        h.get(name)?;
        let unit = if name.ends_with("-ms") { 1 } else { 1000 };
        h.all(name)
            .filter_map(|v| std::str::from_utf8(v).ok())
            .filter_map(|v| time::parse_decimal_ms(v, unit))
            .min()
    })
}

/// How long a request of hold class `class` may be held, in ms (0: it may not be held): its
/// class's longest hold, within its client's timeout less the margin.
pub fn hold_budget_ms(cfg: &Hold, class: usize, h: &Headers) -> u64 {
    let max_ms = cfg.max_ms_of(class);
    if max_ms == 0 || cfg.max_held_of(class) == 0 {
        return 0;
    }
    match client_timeout_ms(cfg, h) {
        Some(t) => max_ms.min(t.saturating_sub(cfg.margin_ms)),
        None => max_ms,
    }
}
