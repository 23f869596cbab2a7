//! The governor: the configuration and what is derived from it, built once at load, immutable
//! and shared by every worker. It decides nothing itself: it hands out the views each job
//! works through (`pools`, `cooldowns`, `limits`, `admission`, `responses`, `replies`, the
//! fleet's `FleetLimits`), each a type in its own module. What a worker does with a stream over
//! time is `worker`'s.

use crate::admission::Admission;
use crate::config::{Config, LimitKind};
use crate::cooldowns::Cooldowns;
use crate::fleet::limits::FleetLimits;
use crate::keys;
use crate::limits::Limits;
use crate::pools::{Ids, Pools};
use crate::predict::Needs;
use crate::reply::Replies;
use crate::response::Responses;

pub use crate::env::{Clock, Env};
pub use crate::request::{Flow, RequestView};
pub use crate::response::{Governed, ResponseStep, FAILOVER_RETRY_MS};

/// The configuration and what is derived from it: immutable after load, and `Sync`, so every
/// worker (and, in a native host, every thread) shares one. Per-worker state is `Worker`'s.
pub struct Governor {
    pub cfg: Config,
    ids: Ids,
    /// Some limit reserves tokens or is keyed by model: the request body is read.
    reads_body: bool,
    /// The limits the fleet's service decides, when there are any.
    fleet: Option<FleetLimits>,
    /// What the reserving token limits need predicted before the call.
    needs: Needs,
}

impl Governor {
    /// The governor of `cfg`, its ids keyed with `key` (the host's secret: see `keys`).
    pub fn new(cfg: Config, key: keys::HashKey) -> Governor {
        let ids = Ids::of(&cfg, key);
        let reads_body = ids.keys_by_model()
            || cfg
                .limits
                .iter()
                .any(|l| l.kind == LimitKind::Tokens && l.reserve);
        let fleet = FleetLimits::of(&cfg);
        let needs = Needs::of(&cfg);
        Governor {
            cfg,
            ids,
            reads_body,
            fleet,
            needs,
        }
    }

    /// The governor of a configuration as a host receives it (JSON), or the message to log:
    /// "invalid configuration: <field>: <reason>".
    pub fn load(json: &[u8], key: keys::HashKey) -> Result<Governor, String> {
        match crate::config::parse(json) {
            Ok(cfg) => Ok(Governor::new(cfg, key)),
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

    /// The fleet limits, when some limit is the fleet's.
    pub fn fleet(&self) -> Option<&FleetLimits> {
        self.fleet.as_ref()
    }

    pub fn pools(&self) -> Pools<'_> {
        Pools::new(&self.cfg, &self.ids, self.fleet.as_ref())
    }

    pub fn cooldowns(&self) -> Cooldowns<'_> {
        Cooldowns::new(&self.cfg)
    }

    /// The local limits, with what bounds their keys.
    pub fn limits(&self) -> Limits<'_> {
        Limits::new(&self.cfg, self.needs, self.fleet.is_some())
    }

    pub fn admission(&self) -> Admission<'_> {
        Admission::new(&self.cfg, self.pools(), self.cooldowns(), self.limits())
    }

    pub fn responses(&self) -> Responses<'_> {
        Responses::new(&self.cfg, self.cooldowns(), self.limits(), self.admission())
    }

    pub fn replies(&self) -> Replies<'_> {
        Replies::new(&self.cfg, self.cooldowns())
    }
}
