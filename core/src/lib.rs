//! The pure core of llm-governor, a filter that owns the spacing of traffic to rate-limited LLM
//! APIs: every decision, tested natively. It names no host ABI. Two hosts depend on it and only
//! translate: the proxy-wasm module (`../src/host/`) and the Envoy dynamic module
//! (`../src/native/`); `protocol` is what both do alike.
//!
//! Where things live:
//! - request data: `request` (`Flow`, `RequestView`), `blocked` (why a request waits);
//! - the jobs, one type each: `pools` (who a request is), `cooldowns` and `cooldown` (the
//!   provider's "not now" and the pace after it), `limits` (local buckets and caps),
//!   `admission` (may it go now), `hold` (waiting instead of the client), `response` (what a
//!   response means), `reply` (local answers), `fleet` (budgets shared through a rate-limit
//!   service);
//! - the composition: `policy` (`Governor`: the configuration and its views), `worker` (one
//!   worker's streams over time, `stream` their states), `effects` and `protocol` (the host
//!   boundary);
//! - counting as the provider counts: `counting` (each provider's rule), `predict` (what a
//!   request will count: cache reads through `prefix` and `prefix_cache`, output from recent
//!   usage);
//! - leaves: `config`, `classify`, `ratelimit`, `retry_after`, `estimate`, `usage`, `headers`,
//!   `time`, `keys`, `keyspace`, `store`, `bucket`, `inflight`, `lease`, `metrics`, `env`,
//!   `deadline`.

pub mod admission;
pub mod blocked;
pub mod bucket;
pub mod classify;
pub mod config;
pub mod cooldown;
pub mod cooldowns;
pub mod counting;
pub mod deadline;
pub mod effects;
pub mod env;
pub mod estimate;
pub mod fleet;
pub mod headers;
pub mod hold;
pub mod inflight;
pub mod keys;
pub mod keyspace;
pub mod lease;
pub mod limits;
pub mod metrics;
pub mod policy;
pub mod pools;
pub mod predict;
pub mod prefix;
pub mod prefix_cache;
pub mod protocol;
pub mod ratelimit;
pub mod reply;
pub mod request;
pub mod response;
pub mod retry_after;
pub mod store;
pub mod stream;
pub mod time;
pub mod usage;
pub mod worker;
