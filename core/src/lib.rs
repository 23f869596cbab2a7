//! The pure core of llm-governor, a filter that owns the spacing of traffic to rate-limited LLM
//! APIs: every decision, tested natively. It names no host ABI; the hosts (the proxy-wasm
//! module in `../src/host/`) depend on it and only translate.

pub mod admission;
pub mod bucket;
pub mod classify;
pub mod config;
pub mod cooldown;
pub mod cooldowns;
pub mod deadline;
pub mod effects;
pub mod env;
pub mod estimate;
pub mod fleet;
pub mod flow;
pub mod headers;
pub mod hold;
pub mod inflight;
pub mod keys;
pub mod keyspace;
pub mod lease;
pub mod limits;
pub mod metrics;
pub mod policy;
pub mod ratelimit;
pub mod reply;
pub mod retry_after;
pub mod rls;
pub mod store;
pub mod stream;
pub mod time;
pub mod usage;
pub mod verdict;
pub mod worker;
