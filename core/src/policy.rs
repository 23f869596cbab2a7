//! The governor: the configuration and what is derived from it, immutable after load and
//! shared by every worker. Its jobs live in their own modules: `flow` (who a request is),
//! `admission` (may it go now), `cooldowns` (the (pool, account) record), `limits` (buckets and
//! caps), `verdict` (what a response means), `reply` (local answers), `keyspace` (bounded keys);
//! what a worker does with a stream over time is `worker`.

use crate::config::{Config, LimitKey, LimitKind};
use crate::keys;
use crate::limits::Limits;

pub use crate::admission::{Admission, Blocked};
pub use crate::env::{Clock, Env};
pub use crate::flow::{Flow, RequestView};
pub use crate::reply::STEERING_HEADER;
pub use crate::verdict::{Governed, ResponseStep, FAILOVER_RETRY_MS};

/// The configuration and what is derived from it: immutable after load, and `Sync`, so every
/// worker (and, in a native host, every thread) shares one. Per-worker state is `Worker`'s.
pub struct Governor {
    pub cfg: Config,
    /// The key of the ids of credentials, tenants and models (`keys::HashKey`).
    pub(crate) ids: keys::HashKey,
    /// Per pool: the id of its name, for `key: pool` limits.
    pub(crate) pool_ids: Vec<u64>,
    /// Per pool: the id of its `account` label, when it names one (hashed once, not per request).
    pub(crate) label_ids: Vec<Option<u64>>,
    /// Some limit reserves tokens or is keyed by model: the request body is read.
    pub(crate) reads_body: bool,
    /// Some limit is keyed by model: the path is searched for one.
    pub(crate) keys_by_model: bool,
    /// The limits the fleet's service decides (`scope: fleet`), by index; token budgets first
    /// (a reservation the fleet holds can be released at no cost if another limit refuses).
    pub(crate) fleet_limits: Vec<usize>,
}

impl Governor {
    /// The governor of `cfg`, its ids keyed with `ids` (the host's secret: see `keys`).
    pub fn new(cfg: Config, ids: keys::HashKey) -> Governor {
        let pool_ids = cfg
            .pools
            .iter()
            .map(|p| ids.id(p.name.as_bytes()))
            .collect();
        let label_ids = cfg
            .pools
            .iter()
            .map(|p| p.account.as_deref().map(|label| ids.id(label.as_bytes())))
            .collect();
        let keys_by_model = cfg
            .limits
            .iter()
            .any(|l| matches!(l.key, LimitKey::Model { .. }));
        let reads_body = keys_by_model
            || cfg
                .limits
                .iter()
                .any(|l| l.kind == LimitKind::Tokens && l.reserve);
        let limits = &cfg.limits;
        let fleet = |tokens: bool| {
            (0..limits.len()).filter(move |&i| {
                let l = &limits[i];
                l.scope == crate::config::Scope::Fleet && (l.kind == LimitKind::Tokens) == tokens
            })
        };
        let fleet_limits: Vec<usize> = fleet(true).chain(fleet(false)).collect();
        Governor {
            cfg,
            ids,
            pool_ids,
            label_ids,
            reads_body,
            keys_by_model,
            fleet_limits,
        }
    }

    /// The governor of a configuration as a host receives it (JSON), or the message to log:
    /// "invalid configuration: <field>: <reason>".
    pub fn load(json: &[u8], ids: keys::HashKey) -> Result<Governor, String> {
        match crate::config::parse(json) {
            Ok(cfg) => Ok(Governor::new(cfg, ids)),
            Err(e) => Err(format!("invalid configuration: {e}")),
        }
    }

    /// The id of a credential, tenant id, model or label: its keyed hash.
    pub fn id(&self, bytes: &[u8]) -> u64 {
        self.ids.id(bytes)
    }

    /// Whether the request body must be read before admission: only when some limit reserves
    /// tokens or is keyed by model. Otherwise the body is never looked at.
    pub fn reads_body(&self) -> bool {
        self.reads_body
    }

    /// The local limits, with what bounds their keys.
    pub fn limits(&self) -> Limits<'_> {
        Limits::new(
            &self.cfg.limits,
            self.cfg.max_keys,
            !self.fleet_limits.is_empty(),
        )
    }
}
