//! llm-governor: a proxy-wasm filter that owns the spacing of traffic to rate-limited LLM APIs.
//!
//! Everything that decides lives in plain Rust modules with no proxy-wasm dependency and is
//! tested natively. `host` is the only module that talks to Envoy.

pub mod bucket;
pub mod classify;
pub mod config;
pub mod cooldown;
pub mod deadline;
pub mod estimate;
pub mod headers;
pub mod hold;
pub mod inflight;
pub mod keys;
pub mod lease;
pub mod limits;
pub mod metrics;
pub mod policy;
pub mod ratelimit;
pub mod reply;
pub mod retry_after;
pub mod store;
pub mod time;
pub mod usage;

#[cfg(target_arch = "wasm32")]
mod host;
