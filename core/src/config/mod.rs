//! The plugin configuration: JSON in, a validated `Config` out, or an error naming the field.
//!
//! One job per file, in the order a configuration goes through them:
//! - `wire`: the configuration as written, serde DTOs (`deny_unknown_fields`) that say which
//!   fields exist; their leaf types (`values`) say what one value may be
//!   (`Int<1, MAX_DURATION_MS>`, `HeaderName`, `StatName`, ...), so a field and its rule are
//!   written once;
//! - `tree`: a deserializer over the parsed JSON that reports where a value was refused
//!   (`limits[0].requests_per_minute: must be > 0`), which is what an operator reading
//!   Envoy's log at 3 a.m. needs;
//! - `rules`: `TryFrom<ConfigDto> for Config` applies the rules that relate fields (required
//!   names, duplicates, fallbacks, one kind per limit), naming the field the same way;
//! - `hold`: the rules of the `hold` section (its classes and what each may match), and
//!   `matcher`: a `match` as pools and classes write it;
//! - `defaults`: what every field left out becomes;
//! - `model`: the validated configuration the rest of the core reads;
//! - this file: `parse`, the way through them.
//!
//! When a configuration has several errors, the one reported is the first value refused in
//! the DTOs' order (unknown fields of an object first), else the first rule between fields.

mod defaults;
mod hold;
mod matcher;
mod model;
mod rules;
mod tree;
mod values;
mod wire;

use serde::Deserialize;
use serde_json::Value;

pub use defaults::{
    DEFAULT_ACCOUNT_HEADERS, DEFAULT_CLASS, DEFAULT_DEADLINE_HEADERS, DEFAULT_FLEET_DOMAIN,
    DEFAULT_FLEET_TIMEOUT_MS, DEFAULT_OUTPUT_TOKENS, DEFAULT_POOL, MIN_OUTPUT_TOKENS,
};
pub use model::*;

/// Parse and validate the plugin configuration. Empty input and `{}` give the defaults.
pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Config::default());
    }
    // Syntax first, as a whole: a truncated file is "not valid JSON", whatever its first
    // field holds. (A key given twice keeps its last value, as JSON parsers do.)
    let root: Value =
        serde_json::from_slice(bytes).map_err(|e| err("", format!("not valid JSON: {e}")))?;
    let dto = wire::ConfigDto::deserialize(tree::Tree(&root))?;
    Config::try_from(dto)
}
