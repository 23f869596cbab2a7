//! Who a request is and which pool governs it: the pool it matches, its account, the keys of
//! its limits; and, when it is steered, the pool it is governed as from then on. Reads the
//! request headers (and body, when read) once, into the `Flow` the rest of the policy reads.

use crate::classify::Dialect;
use crate::config::{Config, LimitKey, LimitKind, Match, Pool};
use crate::deadline;
use crate::estimate;
use crate::fleet::limits::FleetLimits;
use crate::headers::Headers;
use crate::keys::{self, HashKey};
use crate::prefix;
use crate::request::{FleetFlow, Flow, HoldDeadline, RequestView, STEERING_HEADER};

/// What is derived from the configuration once for reading requests: the key of every id, and
/// the ids of pool names and account labels (hashed once, not per request).
pub struct Ids {
    /// The key of the ids of credentials, tenants and models (`keys::HashKey`).
    pub(crate) key: HashKey,
    /// Per pool: the id of its name, for `key: pool` limits.
    pool_ids: Vec<u64>,
    /// Per pool: the id of its `account` label, when it names one.
    label_ids: Vec<Option<u64>>,
    /// Some limit is keyed by model: the path is searched for one.
    keys_by_model: bool,
}

impl Ids {
    pub fn of(cfg: &Config, key: HashKey) -> Ids {
        Ids {
            pool_ids: cfg
                .pools
                .iter()
                .map(|p| key.id(p.name.as_bytes()))
                .collect(),
            label_ids: cfg
                .pools
                .iter()
                .map(|p| p.account.as_deref().map(|label| key.id(label.as_bytes())))
                .collect(),
            keys_by_model: cfg
                .limits
                .iter()
                .map(|l| &l.key)
                .chain(&cfg.hold.fair_key)
                .any(|k| matches!(k, LimitKey::Model { .. })),
            key,
        }
    }

    /// The id of a credential, tenant id, model or label: its keyed hash.
    pub fn id(&self, bytes: &[u8]) -> u64 {
        self.key.id(bytes)
    }

    pub fn keys_by_model(&self) -> bool {
        self.keys_by_model
    }
}

/// The pools of a configuration, as the request path reads them.
#[derive(Clone, Copy)]
pub struct Pools<'a> {
    cfg: &'a Config,
    ids: &'a Ids,
    fleet: Option<&'a FleetLimits>,
}

impl<'a> Pools<'a> {
    pub fn new(cfg: &'a Config, ids: &'a Ids, fleet: Option<&'a FleetLimits>) -> Pools<'a> {
        Pools { cfg, ids, fleet }
    }

    /// The first pool whose match holds; the implicit `default` pool is last and matches all.
    pub fn pool_for(&self, req: &RequestView) -> usize {
        self.cfg
            .pools
            .iter()
            .position(|p| pool_matches(p, req))
            .unwrap_or(self.cfg.pools.len().saturating_sub(1))
    }

    /// The id of the credential: the first present account header, hashed. A `Bearer ` prefix
    /// is dropped so the same key sent as `authorization` or as `x-api-key` is one account.
    pub fn account_of(&self, h: &Headers) -> u64 {
        self.cfg
            .account_headers
            .iter()
            .find_map(|name| h.get(name).map(strip_bearer).filter(|v| !v.is_empty()))
            .map_or(keys::NO_ACCOUNT, |v| self.ids.id(v))
    }

    /// Everything the policy needs from the request headers, read once: among it, its hold
    /// class and how long it may be held from its arrival.
    pub fn flow_for(&self, req: &RequestView) -> Flow {
        let pool = self.pool_for(req);
        let hold = &self.cfg.hold;
        let hold_class = match hold.classes.len() {
            1 => 0,
            n => hold.classes[..n - 1]
                .iter()
                .position(|c| matches(&c.matcher, req))
                .unwrap_or(n - 1),
        };
        let fair_id = hold
            .fair_key
            .as_ref()
            .and_then(LimitKey::header)
            .map_or(0, |name| self.ids.id(req.headers.get(name).unwrap_or(b"-")));
        let client_account = self.account_of(&req.headers);
        let header_ids = self
            .cfg
            .limits
            .iter()
            .map(|l| {
                l.key
                    .header()
                    .map_or(0, |name| self.ids.id(req.headers.get(name).unwrap_or(b"-")))
            })
            .collect();
        let model_id = match self.ids.keys_by_model {
            true => keys::model_in_path(req.path).map_or(keys::NO_MODEL, |m| self.ids.id(m)),
            false => keys::NO_MODEL,
        };
        let dialect = self.cfg.pools[pool]
            .dialect
            .resolve_for_request(req.path, &req.headers);
        let mut flow = Flow {
            pool,
            account: client_account,
            home_pool: pool,
            client_account,
            home_dialect: dialect,
            header_ids,
            model_id,
            estimate: None,
            prompt: None,
            predicted: None,
            dialect,
            streak: 0,
            limit_keys: Vec::new(),
            charges: Vec::new(),
            slots: Vec::new(),
            released: None,
            held_ms: None,
            hold: HoldDeadline::new(deadline::hold_budget_ms(hold, hold_class, &req.headers)),
            hold_class,
            fair_id,
            client_retry: is_client_retry(&req.headers),
            fleet: None,
        };
        if let Some(fleet) = self.fleet {
            flow.fleet = Some(Box::new(FleetFlow {
                keys: fleet.keys_of(self.cfg, req.path, &req.headers),
                ..FleetFlow::default()
            }));
        }
        self.govern_as(&mut flow, pool);
        flow
    }

    /// Make `pool` the one that governs the flow: its account, its limit keys, its dialect
    /// (for a steered request; the home pool keeps the one resolved from the request).
    pub fn govern_as(&self, flow: &mut Flow, pool: usize) {
        let p = &self.cfg.pools[pool];
        flow.pool = pool;
        flow.account = self.ids.label_ids[pool].unwrap_or(flow.client_account);
        flow.dialect = match p.dialect {
            _ if pool == flow.home_pool => flow.home_dialect,
            Dialect::Auto => flow.home_dialect,
            d => d,
        };
        let ids = self.ids;
        flow.limit_keys = self
            .cfg
            .limits
            .iter()
            .zip(&flow.header_ids)
            .map(|(l, id)| match l.key {
                LimitKey::Header(_) => *id,
                LimitKey::Account => flow.account,
                LimitKey::Pool => ids.pool_ids[pool],
                LimitKey::Model { header: None } => flow.model_id,
                LimitKey::Model { header: Some(_) } => ids.key.mix(*id, flow.model_id),
            })
            .collect();
    }

    /// What the request body tells (the first `estimate::MAX_BODY` bytes of it; `total_len`
    /// is the whole length when known to be larger): the tokens to reserve, and the model
    /// when its path did not name one.
    pub fn on_request_body(&self, flow: &mut Flow, body: &[u8], total_len: usize) {
        let est = estimate::estimate(body, total_len);
        if flow.model_id == keys::NO_MODEL {
            if let Some(model) = est.model.and_then(|(from, to)| body.get(from..to)) {
                flow.model_id = self.ids.id(model);
                if let Some(fleet) = self.fleet {
                    fleet.model_found(self.cfg, flow, model);
                }
            }
        }
        flow.prompt = self
            .predicts_cache_reads()
            .then(|| prefix::scan(body, est.input, &self.ids.key).map(Box::new))
            .flatten();
        flow.estimate = Some(est);
        self.govern_as(flow, flow.pool);
    }

    /// Whether some token limit reserves input that a provider's cache read would not count:
    /// then a body's cache breakpoints are read.
    fn predicts_cache_reads(&self) -> bool {
        self.cfg.limits.iter().any(|l| {
            l.kind == LimitKind::Tokens && l.reserve && l.counts.input() && !l.count_cache_reads
        })
    }

    /// The value of `hold.fair_key` for the flow (0 without one): whose turn a release is.
    pub fn fair_value(&self, flow: &Flow) -> u64 {
        match self.cfg.hold.fair_key {
            None => 0,
            Some(LimitKey::Header(_)) => flow.fair_id,
            Some(LimitKey::Account) => flow.client_account,
            Some(LimitKey::Pool) => self.ids.pool_ids[flow.home_pool],
            Some(LimitKey::Model { header: None }) => flow.model_id,
            Some(LimitKey::Model { header: Some(_) }) => {
                self.ids.key.mix(flow.fair_id, flow.model_id)
            }
        }
    }

    /// The pool the request was steered to, when it was.
    pub fn steered_to(&self, flow: &Flow) -> Option<&'a str> {
        (flow.pool != flow.home_pool).then(|| self.cfg.pools[flow.pool].name.as_str())
    }
}

/// The official SDKs send `x-stainless-retry-count` on every attempt: 0 on the first, n on the
/// n-th retry. Anything but a positive integer is not a retry.
fn is_client_retry(h: &Headers) -> bool {
    h.get_str("x-stainless-retry-count")
        .and_then(|v| v.parse::<u32>().ok())
        .is_some_and(|n| n > 0)
}

fn strip_bearer(v: &[u8]) -> &[u8] {
    match v.get(..7) {
        Some(p) if p.eq_ignore_ascii_case(b"bearer ") => v[7..].trim_ascii_start(),
        _ => v,
    }
}

fn pool_matches(p: &Pool, req: &RequestView) -> bool {
    matches(&p.matcher, req)
}

/// Whether `req` meets every condition of `m` (a pool's or a hold class's).
fn matches(m: &Match, req: &RequestView) -> bool {
    m.path_prefix
        .as_ref()
        .map_or(true, |pre| req.path.starts_with(pre.as_bytes()))
        && m.authority
            .as_ref()
            .map_or(true, |a| req.authority.eq_ignore_ascii_case(a.as_bytes()))
        && m.header.as_ref().map_or(true, |(n, v)| {
            // The steering header is only ever the policy's own: a pool matched on it is
            // reached by steering alone, never by what a client sends (a class, never).
            n != STEERING_HEADER && req.headers.get(n) == Some(v.as_bytes())
        })
}
