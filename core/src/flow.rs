//! Who a request is and which pool governs it: the flow the request path builds from the
//! headers (and body, when read), carried to the response path of the same stream.

use crate::classify::Dialect;
use crate::config::{LimitKey, Pool};
use crate::estimate::{self, Estimate};
use crate::fleet::FleetCharge;
use crate::headers::Headers;
use crate::inflight::Slot;
use crate::keys;
use crate::limits::Taken;
use crate::policy::Governor;
use crate::reply::STEERING_HEADER;

/// The parts of a request the policy looks at.
pub struct RequestView<'a> {
    pub path: &'a [u8],
    pub authority: &'a [u8],
    pub headers: Headers<'a>,
}

impl<'a> RequestView<'a> {
    /// The view of a request whose header list carries its `:path` and `:authority`, as an
    /// Envoy header map does.
    pub fn of(headers: Headers<'a>) -> RequestView<'a> {
        RequestView {
            path: headers.get(":path").unwrap_or(b""),
            authority: headers.get(":authority").unwrap_or(b""),
            headers,
        }
    }
}

/// What the request path learned, carried to the response path of the same stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flow {
    /// The pool that governs the request: its own, or the fallback it was steered to.
    pub pool: usize,
    pub account: u64,
    /// The pool the request matched, and the account of the client's own credential.
    pub home_pool: usize,
    pub client_account: u64,
    pub home_dialect: Dialect,
    /// Per configured limit, the id of the keying header's value (header-keyed limits only).
    pub header_ids: Vec<u64>,
    /// The id of the request's model, for `model` keys (`keys::NO_MODEL` until known).
    pub model_id: u64,
    /// What the request body says it will cost, when it was read (a token limit reserves).
    pub estimate: Option<Estimate>,
    /// The dialect for locally generated bodies (`auto` resolved from the request).
    pub dialect: Dialect,
    /// Consecutive failed cooldown rounds of this (pool, account), read with its cooldown:
    /// a success resets them.
    pub streak: u8,
    /// Per configured limit, the id of this request's key.
    pub limit_keys: Vec<u64>,
    /// Token buckets to settle with the response's usage: (limit index, shared-data key,
    /// tokens reserved before forwarding; 0 when the budget is charged after the response).
    pub charges: Vec<Charge>,
    /// `max_in_flight` slots this request holds until its stream ends.
    pub slots: Vec<HeldSlot>,
    /// It took a release of the pace after a cooldown; its answer is owed to the pace.
    pub released: bool,
    /// How long the gateway held it, when it did.
    pub held_ms: Option<u64>,
    /// When it was held: the moment its hold budget runs out.
    pub hold_deadline_ms: Option<u64>,
    /// The client says this attempt is a retry (`x-stainless-retry-count` > 0).
    pub client_retry: bool,
    /// What fleet limits need of the request (None without fleet limits: one pointer).
    pub fleet: Option<Box<FleetFlow>>,
}

/// What a request under fleet limits carries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetFlow {
    /// What the local limits took, given back if the fleet refuses.
    pub taken: Vec<Taken>,
    /// (limit index, the raw key value) of fleet limits keyed by a header that is not a
    /// credential, or by model: what the descriptor carries.
    pub keys: Vec<(usize, String)>,
    /// Token budgets the fleet charged at admission, settled when the stream ends.
    pub charges: Vec<FleetCharge>,
}

/// A token budget a request is charged to when its stream ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Charge {
    /// The limit's index in the configuration.
    pub limit: usize,
    /// The bucket's shared-data key.
    pub key: String,
    /// Tokens reserved before forwarding; 0 when the budget is charged after the response.
    pub reserved: u64,
}

/// A `max_in_flight` slot a request holds until its stream ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldSlot {
    pub limit: usize,
    pub key: String,
    pub slot: Slot,
}

impl Flow {
    /// Whether its stream's end must be reported: slots to give back, a pace answer owed.
    pub fn owes_at_end(&self) -> bool {
        !self.slots.is_empty() || self.released || self.fleet_charged()
    }

    /// Whether the fleet charged it a token budget, settled at the end.
    pub fn fleet_charged(&self) -> bool {
        self.fleet.as_ref().is_some_and(|f| !f.charges.is_empty())
    }

    /// What fleet limits need of it (made on first use).
    pub fn fleet_mut(&mut self) -> &mut FleetFlow {
        self.fleet.get_or_insert_with(Box::default)
    }

    /// Whether it holds a token reservation to settle (locally or at the fleet).
    pub fn reserves(&self) -> bool {
        self.charges.iter().any(|c| c.reserved > 0) || self.fleet_charged()
    }
}

impl Governor {
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
            .map_or(keys::NO_ACCOUNT, |v| self.id(v))
    }

    /// Everything the policy needs from the request headers, read once.
    pub fn flow_for(&self, req: &RequestView) -> Flow {
        let pool = self.pool_for(req);
        let client_account = self.account_of(&req.headers);
        let header_ids = self
            .cfg
            .limits
            .iter()
            .map(|l| {
                l.key
                    .header()
                    .map_or(0, |name| self.id(req.headers.get(name).unwrap_or(b"-")))
            })
            .collect();
        let model_id = match self.keys_by_model {
            true => keys::model_in_path(req.path).map_or(keys::NO_MODEL, |m| self.id(m)),
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
            dialect,
            streak: 0,
            limit_keys: Vec::new(),
            charges: Vec::new(),
            slots: Vec::new(),
            released: false,
            held_ms: None,
            hold_deadline_ms: None,
            client_retry: is_client_retry(&req.headers),
            fleet: None,
        };
        if !self.fleet_limits.is_empty() {
            flow.fleet = Some(Box::new(FleetFlow {
                keys: self.fleet_keys_of(req.path, &req.headers),
                ..FleetFlow::default()
            }));
        }
        self.govern_as(&mut flow, pool);
        flow
    }

    /// Make `pool` the one that governs the flow: its account, its limit keys, its dialect
    /// (for a steered request; the home pool keeps the one resolved from the request).
    pub(crate) fn govern_as(&self, flow: &mut Flow, pool: usize) {
        let p = &self.cfg.pools[pool];
        flow.pool = pool;
        flow.account = self.label_ids[pool].unwrap_or(flow.client_account);
        flow.dialect = match p.dialect {
            _ if pool == flow.home_pool => flow.home_dialect,
            Dialect::Auto => flow.home_dialect,
            d => d,
        };
        flow.limit_keys = self
            .cfg
            .limits
            .iter()
            .zip(&flow.header_ids)
            .map(|(l, id)| match l.key {
                LimitKey::Header(_) => *id,
                LimitKey::Account => flow.account,
                LimitKey::Pool => self.pool_ids[pool],
                LimitKey::Model { header: None } => flow.model_id,
                LimitKey::Model { header: Some(_) } => self.ids.mix(*id, flow.model_id),
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
                flow.model_id = self.id(model);
                if !self.fleet_limits.is_empty() {
                    self.fleet_model_found(flow, model);
                }
            }
        }
        flow.estimate = Some(est);
        self.govern_as(flow, flow.pool);
    }

    /// The pool the request was steered to, when it was.
    pub fn steered_to(&self, flow: &Flow) -> Option<&str> {
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
    let m = &p.matcher;
    m.path_prefix
        .as_ref()
        .map_or(true, |pre| req.path.starts_with(pre.as_bytes()))
        && m.authority
            .as_ref()
            .map_or(true, |a| req.authority.eq_ignore_ascii_case(a.as_bytes()))
        && m.header.as_ref().map_or(true, |(n, v)| {
            // The steering header is only ever the policy's own: a pool matched on it is
            // reached by steering alone, never by what a client sends.
            n != STEERING_HEADER && req.headers.get(n) == Some(v.as_bytes())
        })
}
