//! The decisions: whether a request may go now, what to tell a client that must wait, and
//! what a response means for the (pool, account) it came from.
//!
//! The shared store, the metrics sink and the randomness come in as traits and `now` as a
//! value, so every path is driven natively in tests exactly as the host drives it. The rules
//! themselves live in their own modules: `cooldown` (merge and pace), `limits` (buckets and
//! slots), `hold` (what a worker does with requests that must wait).

use crate::classify::{self, Class, Dialect};
use crate::config::{Config, LimitKey, LimitKind, Pool};
use crate::cooldown::{self, Answer, CooldownRecord, Gate, Wanted};
pub use crate::env::{Clock, Env};
use crate::estimate::{self, Estimate};
use crate::headers::Headers;
use crate::inflight::Slot;
use crate::keys;
use crate::metrics::{Counter, Gauge, Histogram, Metrics};
use crate::ratelimit::{self, Snapshot};
use crate::reply::{self, AnswerSource, LimitFields, LocalReply};
use crate::retry_after;
use crate::store::{self, UpdateError};

pub use crate::reply::STEERING_HEADER;

/// What a client is told after an upstream "not now" when a fallback has room: come back at
/// once (its retry is steered there). A few ms rather than 0, which SDKs would not trust.
pub const FAILOVER_RETRY_MS: u64 = 5;

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
    pub charges: Vec<(usize, String, u64)>,
    /// `max_in_flight` slots this request holds until its stream ends.
    pub slots: Vec<(usize, String, Slot)>,
    /// It took a release of the pace after a cooldown; its answer is owed to the pace.
    pub released: bool,
    /// How long the gateway held it, when it did.
    pub held_ms: Option<u64>,
    /// The client says this attempt is a retry (`x-stainless-retry-count` > 0).
    pub client_retry: bool,
}

impl Flow {
    /// Whether its stream's end must be reported: slots to give back, a pace answer owed.
    pub fn owes_at_end(&self) -> bool {
        !self.slots.is_empty() || self.released
    }

    /// Whether it holds a token reservation to settle.
    pub fn reserves(&self) -> bool {
        self.charges.iter().any(|(_, _, reserved)| *reserved > 0)
    }
}

/// Why a request cannot go now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocked {
    /// The provider is cooling this (pool, account).
    Cooling { class: Class, remaining_ms: u64 },
    /// The cooldown ended and the pace has no release open.
    Paced { retry_in_ms: u64 },
    /// A request bucket (or token budget) is empty.
    Bucket {
        limit: usize,
        wait_ms: u64,
        remaining: u64,
    },
    /// A `max_in_flight` cap is full.
    InFlight { limit: usize },
    /// The provider reported this account's quota exhausted: waiting cannot help.
    Quota { remaining_ms: u64 },
    /// The request's reservation is larger than the token budget can ever hold.
    TooLarge { limit: usize, tokens: u64 },
}

impl Blocked {
    /// How long the wait is known to last; None when it ends with an event (an answer, a
    /// stream's end) rather than at a time.
    pub fn wait_ms(&self) -> Option<u64> {
        match *self {
            Blocked::Cooling { remaining_ms, .. } => Some(remaining_ms),
            Blocked::Bucket { wait_ms, .. } => Some(wait_ms),
            Blocked::Paced { .. }
            | Blocked::InFlight { .. }
            | Blocked::Quota { .. }
            | Blocked::TooLarge { .. } => None,
        }
    }

    /// Whether holding can help: everything but quota exhaustion and a request too large.
    pub fn holdable(&self) -> bool {
        !matches!(self, Blocked::Quota { .. } | Blocked::TooLarge { .. })
    }

    /// Whether a fallback pool can serve the request instead: the provider side is saying
    /// "not now" (cooling, pacing, quota) or the pool's concurrency cap is full. An empty local
    /// bucket is the operator's own limit for the tenant and is never steered around.
    pub fn steerable(&self) -> bool {
        !matches!(self, Blocked::Bucket { .. } | Blocked::TooLarge { .. })
    }

    /// When to ask again, at the latest. Waits that end with an event (an answer, a stream's
    /// end, on any worker) are asked again on every tick.
    pub fn recheck_in_ms(&self) -> u64 {
        match *self {
            Blocked::Cooling { remaining_ms, .. } => remaining_ms,
            Blocked::Bucket { wait_ms, .. } => wait_ms,
            Blocked::Paced { .. }
            | Blocked::InFlight { .. }
            | Blocked::Quota { .. }
            | Blocked::TooLarge { .. } => 0,
        }
    }
}

/// Whether a request may go now.
#[derive(Debug)]
pub enum Admission {
    /// Forward it; its flow holds what it took (and names the pool it was steered to).
    Go,
    /// It cannot go now: hold it if `holdable`, or answer it with `Governor::reply_for`.
    Wait(Blocked),
}

/// What the response path decided for a governed response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Governed {
    pub class: Class,
    /// What the client is told, in ms.
    pub delay_ms: u64,
    /// The provider's own delay, when it gave one.
    pub provider_ms: Option<u64>,
    pub headers: Vec<(&'static str, String)>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum ResponseStep {
    /// Not a governed response: let it through untouched.
    Pass,
    /// Hold the headers: the class depends on the error body.
    NeedBody,
    /// Rewrite the response headers and let it through.
    Rewrite(Governed),
}

/// The configuration and what is derived from it: immutable after load, and `Sync`, so every
/// worker (and, in a native host, every thread) shares one. Per-worker state is `Worker`'s.
pub struct Governor {
    pub cfg: Config,
    /// The key of the ids of credentials, tenants and models (`keys::HashKey`).
    ids: keys::HashKey,
    /// Per pool: the id of its name, for `key: pool` limits.
    pub(crate) pool_ids: Vec<u64>,
    /// Some limit reserves tokens or is keyed by model: the request body is read.
    reads_body: bool,
    /// Some limit is keyed by model: the path is searched for one.
    keys_by_model: bool,
}

impl Governor {
    /// The governor of `cfg`, its ids keyed with `ids` (the host's secret: see `keys`).
    pub fn new(cfg: Config, ids: keys::HashKey) -> Governor {
        let pool_ids = cfg
            .pools
            .iter()
            .map(|p| ids.id(p.name.as_bytes()))
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
        Governor {
            cfg,
            ids,
            pool_ids,
            reads_body,
            keys_by_model,
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
            client_retry: is_client_retry(&req.headers),
        };
        self.govern_as(&mut flow, pool);
        flow
    }

    /// Make `pool` the one that governs the flow: its account, its limit keys, its dialect
    /// (for a steered request; the home pool keeps the one resolved from the request).
    fn govern_as(&self, flow: &mut Flow, pool: usize) {
        let p = &self.cfg.pools[pool];
        flow.pool = pool;
        flow.account = p
            .account
            .as_deref()
            .map_or(flow.client_account, |label| self.id(label.as_bytes()));
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
            }
        }
        flow.estimate = Some(est);
        self.govern_as(flow, flow.pool);
    }

    /// The pool the request was steered to, when it was.
    pub fn steered_to(&self, flow: &Flow) -> Option<&str> {
        (flow.pool != flow.home_pool).then(|| self.cfg.pools[flow.pool].name.as_str())
    }

    /// Count a client retry (once per request, on its home pool).
    pub fn on_arrival(&self, flow: &Flow, env: &mut Env) {
        if flow.client_retry {
            env.metrics.count(flow.home_pool, Counter::ClientRetries);
        }
    }

    /// Whether the request may go now, on its own pool or, when that one's provider says "not
    /// now" or its cap is full, on the first of its fallbacks that can take it (failover comes
    /// before holding). On `Go` the flow holds what it took and is governed as the pool it
    /// goes to. When no candidate can take it, the flow is left on the candidate that frees
    /// first (known waits first, the home pool on ties) and `Wait` says why.
    pub fn admit(&self, flow: &mut Flow, env: &mut Env) -> Admission {
        let home = flow.home_pool;
        if flow.pool != home {
            self.govern_as(flow, home);
        }
        let blocked = match self.admit_here(flow, env) {
            Ok(()) => return Admission::Go,
            Err(b) => b,
        };
        let fallback = &self.cfg.pools[home].fallback;
        if fallback.is_empty() || !blocked.steerable() {
            return Admission::Wait(blocked);
        }
        let mut best = (home, blocked);
        for &pool in fallback {
            let mut candidate = flow.clone();
            self.govern_as(&mut candidate, pool);
            match self.admit_here(&mut candidate, env) {
                Ok(()) => {
                    env.metrics.count(home, Counter::Failover);
                    *flow = candidate;
                    return Admission::Go;
                }
                Err(b) if frees_sooner(&b, &best.1) => best = (pool, b),
                Err(_) => {}
            }
        }
        if best.0 != home {
            self.govern_as(flow, best.0);
        }
        Admission::Wait(best.1)
    }

    /// Admission on the flow's current pool alone.
    fn admit_here(&self, flow: &mut Flow, env: &mut Env) -> Result<(), Blocked> {
        if self.cfg.cooldown.enabled {
            match self.pass_cooldown(flow, env) {
                Gate::Open | Gate::Released => {}
                Gate::Cooling {
                    class: Class::QuotaExhausted,
                    remaining_ms,
                } => return Err(Blocked::Quota { remaining_ms }),
                Gate::Cooling {
                    class,
                    remaining_ms,
                } => {
                    return Err(Blocked::Cooling {
                        class,
                        remaining_ms,
                    })
                }
                Gate::Paced { retry_in_ms } => return Err(Blocked::Paced { retry_in_ms }),
            }
        }
        self.take_limits(flow, env).inspect_err(|_| {
            self.give_back_release(flow, env);
        })
    }

    /// Whether some fallback of the flow's home pool (other than the pool that just answered)
    /// could take a request now: not cooling, not out of quota, its caps not full. Read-only.
    pub fn fallback_has_room(&self, flow: &Flow, env: &mut Env) -> bool {
        let home = flow.home_pool;
        std::iter::once(home)
            .chain(self.cfg.pools[home].fallback.iter().copied())
            .filter(|p| *p != flow.pool)
            .any(|pool| {
                let mut candidate = flow.clone();
                self.govern_as(&mut candidate, pool);
                self.has_room(&candidate, env)
            })
    }

    /// The local answer for a request that cannot go now (and is not, or no longer, held).
    pub fn reply_for(&self, flow: &Flow, blocked: &Blocked, env: &mut Env) -> LocalReply {
        let ra = &self.cfg.retry_after;
        let (class, source, delay, counter, fields) = match *blocked {
            Blocked::Cooling {
                class,
                remaining_ms,
            } => {
                let rec = self.cooldown_record(flow, env);
                let (period, spread, streak) =
                    rec.map_or((0, 0, 0), |r| (r.period_ms, r.spread_ms, r.streak));
                // After failed rounds (with `escalate`), clients wait the extra periods the
                // upstream answers told them. The jitter is a fraction of the episode's period,
                // not of what is left: clients answered late in a cooldown would otherwise all
                // come back within a few milliseconds of the deadline and collide there.
                let extra = self.stretch(streak) - 1;
                let wait = remaining_ms.saturating_add(u64::from(period).saturating_mul(extra));
                let delay = retry_after::told(wait, u64::from(spread), ra, env.rng);
                (
                    class,
                    AnswerSource::Cooldown,
                    delay,
                    Counter::LocalRejectCooldown,
                    None,
                )
            }
            Blocked::Paced { retry_in_ms } => {
                let delay = retry_after::told(retry_in_ms, retry_in_ms, ra, env.rng);
                (
                    Class::RateLimited,
                    AnswerSource::Cooldown,
                    delay,
                    Counter::LocalRejectCooldown,
                    None,
                )
            }
            Blocked::Bucket {
                limit,
                wait_ms,
                remaining,
            } => {
                let l = &self.cfg.limits[limit];
                let fields = LimitFields {
                    name: l.name.clone(),
                    quota: l.per_minute,
                    window_s: 60,
                    remaining,
                    reset_s: wait_ms.div_ceil(1000),
                };
                (
                    Class::RateLimited,
                    AnswerSource::Limit,
                    wait_ms.clamp(1, ra.max_ms),
                    Counter::LocalRejectLimit,
                    Some(fields),
                )
            }
            // Told exactly the time left, without jitter: its clients are told not to retry.
            Blocked::Quota { remaining_ms } => (
                Class::QuotaExhausted,
                AnswerSource::Cooldown,
                retry_after::told(remaining_ms, 0, ra, env.rng),
                Counter::LocalRejectQuota,
                None,
            ),
            Blocked::TooLarge { limit, tokens } => {
                return self.too_large(flow, limit, tokens, env);
            }
            Blocked::InFlight { .. } => {
                // A slot frees when some stream ends, which no header foretells: the
                // configured base delay, with jitter so the returning clients spread out.
                let delay = retry_after::told(ra.default_ms, ra.default_ms, ra, env.rng);
                (
                    Class::RateLimited,
                    AnswerSource::Limit,
                    delay,
                    Counter::LocalRejectLimit,
                    None,
                )
            }
        };
        env.metrics.count(flow.pool, counter);
        env.metrics
            .histogram(flow.pool, Histogram::RetryAfterMs, delay);
        let mut reply = reply::local_reply(flow.dialect, class, source, delay, fields.as_ref());
        if let Some(held) = flow.held_ms {
            reply.held(held);
        }
        reply
    }

    /// A request whose reservation no bucket of this size can ever hold: refused at once, and
    /// its client told not to retry (OpenAI answers "Request too large" the same way).
    fn too_large(&self, flow: &Flow, limit: usize, tokens: u64, env: &mut Env) -> LocalReply {
        let l = &self.cfg.limits[limit];
        env.metrics.count(flow.pool, Counter::LocalRejectLimit);
        let message = format!(
            "llm_governor: this request reserves {tokens} tokens (estimated input plus its output \
             limit) and local limit {:?} holds at most {}; it can never be admitted: lower \
             max_tokens or shorten the prompt",
            l.name, l.burst
        );
        reply::too_large(flow.dialect, &l.name, l.per_minute, &message)
    }

    fn cooldown_key(&self, flow: &Flow) -> String {
        keys::cooldown_key(&self.cfg.pools[flow.pool].name, flow.account)
    }

    pub(crate) fn cooldown_record(&self, flow: &Flow, env: &Env) -> Option<CooldownRecord> {
        let (bytes, _) = env.store.get(&self.cooldown_key(flow)).ok().flatten()?;
        CooldownRecord::decode(&bytes)
    }

    /// The cooldown gate: read the record (one copy, the common case writes nothing) and take
    /// a release of the pace when pacing.
    fn pass_cooldown(&self, flow: &mut Flow, env: &mut Env) -> Gate {
        let key = self.cooldown_key(flow);
        let known = match env.store.get(&key) {
            Ok(Some(v)) => v,
            _ => return Gate::Open,
        };
        let paced = self.cfg.hold.enabled();
        let now = env.now();
        let result = store::update_from(env.store, &key, Some(known), None, |cur| {
            match cur.and_then(CooldownRecord::decode) {
                Some(rec) => {
                    let (gate, write) = cooldown::pass(rec, now, paced);
                    (write.map(|r| r.encode().to_vec()), (gate, rec.streak))
                }
                None => (None, (Gate::Open, 0)),
            }
        });
        match result {
            Ok(u) => {
                let (gate, streak) = u.value;
                flow.streak = streak;
                flow.released = gate == Gate::Released;
                gate
            }
            Err(e) => {
                self.store_failed(flow.pool, &key, &e, env);
                Gate::Open
            }
        }
    }

    /// A later gate refused after the pace released this request: give the release back.
    fn give_back_release(&self, flow: &mut Flow, env: &mut Env) {
        if !std::mem::take(&mut flow.released) {
            return;
        }
        let key = self.cooldown_key(flow);
        let result = store::update(env.store, &key, None, |cur| {
            let write = cur
                .and_then(CooldownRecord::decode)
                .map(|r| cooldown::unpass(r).encode().to_vec());
            (write, ())
        });
        if let Err(e) = result {
            self.store_failed(flow.pool, &key, &e, env);
        }
    }

    /// Consecutive rounds that ended in "not now", counting this answer. Answers that arrive
    /// while a cooldown is running belong to its round; one that arrives after it ended, with
    /// no success since, starts the next round.
    fn failed_rounds(&self, flow: &Flow, env: &Env) -> u8 {
        match self.cooldown_record(flow, env) {
            Some(r) if r.deadline_ms > env.now() => r.streak.max(1),
            Some(r) => r.streak.saturating_add(1),
            None => 1,
        }
    }

    /// How many provider periods clients are told to wait after `rounds` failed rounds.
    fn stretch(&self, rounds: u8) -> u64 {
        if self.cfg.retry_after.escalate {
            1u64 << u32::from(rounds.saturating_sub(1).min(10))
        } else {
            1
        }
    }

    pub(crate) fn store_failed(&self, pool: usize, key: &str, e: &UpdateError, env: &mut Env) {
        env.metrics.count(pool, Counter::StoreContention);
        if let UpdateError::Host(msg) = e {
            log::warn!(
                "llm_governor: shared data update of {key} failed ({msg}); a request budget admits the request, a max_in_flight cap makes it wait"
            );
        }
    }

    /// True when `key` exists or the budget counted in `count_key` has room for one more key;
    /// counts overflow otherwise.
    fn key_exists_or_admit(&self, key: &str, count_key: &str, pool: usize, env: &mut Env) -> bool {
        matches!(env.store.get(key), Ok(Some(_))) || self.admit_new_key(count_key, pool, env)
    }

    /// Whether the budget counted in `count_key` has room for one more key (and count it);
    /// counts overflow otherwise.
    pub(crate) fn admit_new_key(&self, count_key: &str, pool: usize, env: &mut Env) -> bool {
        let max = self.cfg.max_keys;
        let admitted = store::update(env.store, count_key, None, |cur| {
            let n = cur
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .unwrap_or(0);
            if n >= max {
                (None, false)
            } else {
                (Some((n + 1).to_le_bytes().to_vec()), true)
            }
        });
        // A contended count admits the key: the bound is then exceeded by at most the number
        // of racing workers, and memory stays bounded.
        let admitted = admitted.map_or(true, |u| u.value);
        if !admitted {
            env.metrics.count(pool, Counter::OverflowKeys);
        }
        admitted
    }

    /// The response headers arrived. Export the provider's rate-limit headers, start a
    /// preemptive cooldown when they say nothing is left, report to the pace, and decide
    /// whether this is a governed response and whether its body is needed.
    pub fn on_response_headers(
        &self,
        flow: &mut Flow,
        status: u16,
        headers: &Headers,
        end_of_stream: bool,
        body_available: bool,
        env: &mut Env,
    ) -> ResponseStep {
        let snap = ratelimit::parse(headers, &|| env.now());
        export_gauges(flow.pool, &snap, env.metrics);
        if !classify::is_governed_status(status) {
            if (200..300).contains(&status) {
                self.on_success(flow, &snap, env);
            } else {
                self.answer_pace(flow, Answer::Other, env);
            }
            return ResponseStep::Pass;
        }
        if classify::needs_body(status) && !end_of_stream && body_available {
            return ResponseStep::NeedBody;
        }
        self.govern(flow, status, headers, &[], &snap, env)
            .map_or(ResponseStep::Pass, ResponseStep::Rewrite)
    }

    /// The provider answered with an error of its own (not Envoy's): it used no tokens, so
    /// the flow's reservations are given back in full.
    pub fn on_upstream_error(&self, flow: &mut Flow, env: &mut Env) {
        if flow.reserves() {
            self.refund(flow, env);
        }
    }

    /// Envoy answered this request itself (an upstream reset or connect failure, a timeout):
    /// not the provider's word, so nothing is classified or cooled. The pace only learns that
    /// the released request will not answer.
    pub fn on_envoy_response(&self, flow: &mut Flow, env: &mut Env) {
        self.answer_pace(flow, Answer::Other, env);
    }

    /// The (bounded prefix of the) error body of a held response arrived.
    pub fn on_response_body(
        &self,
        flow: &mut Flow,
        status: u16,
        headers: &Headers,
        body: &[u8],
        env: &mut Env,
    ) -> Option<Governed> {
        let snap = ratelimit::parse(headers, &|| env.now());
        self.govern(flow, status, headers, body, &snap, env)
    }

    /// The stream is over, however it ended: give back its slots, tell the pace if its answer
    /// never came, and charge the tokens the provider reported.
    pub fn on_stream_end(&self, flow: &mut Flow, usage: Option<u64>, env: &mut Env) {
        self.release_slots(flow, env);
        self.answer_pace(flow, Answer::Other, env);
        if let Some(tokens) = usage {
            self.on_usage(flow, tokens, env);
        }
    }

    fn on_success(&self, flow: &mut Flow, snap: &Snapshot, env: &mut Env) {
        if flow.client_retry {
            env.metrics
                .count(flow.home_pool, Counter::SucceededAfterRetry);
        }
        if !self.cfg.cooldown.enabled {
            return;
        }
        if self.cfg.preemptive {
            // A request that reserved tokens knows how many the next one like it needs.
            let need = flow.charges.iter().map(|c| c.2).max().filter(|n| *n > 0);
            if let Some(reset) = snap.exhausted_wait_ms(need).filter(|ms| *ms > 0) {
                let ms = reset.min(self.cfg.cooldown.max_ms);
                let wanted = Some(Wanted {
                    class: Class::RateLimited,
                    ms,
                });
                let answer = Answer::NotNow {
                    requests_left: false,
                };
                if self.cool(flow, wanted, 0, answer, env) {
                    env.metrics.count(flow.pool, Counter::PreemptiveCooldown);
                }
                return;
            }
        }
        if flow.released || flow.streak > 0 {
            let answer = Answer::Success {
                remaining: snap.requests.remaining,
            };
            self.cool(flow, None, 0, answer, env);
        }
    }

    /// Report a non-success answer (or none) of a released request to the pace.
    fn answer_pace(&self, flow: &mut Flow, answer: Answer, env: &mut Env) {
        if !flow.released {
            return;
        }
        let key = self.cooldown_key(flow);
        let result = store::update(env.store, &key, None, |cur| {
            let write = cur
                .and_then(CooldownRecord::decode)
                .map(|r| cooldown::answered(r, answer, true).encode().to_vec());
            (write, ())
        });
        flow.released = false;
        if let Err(e) = result {
            self.store_failed(flow.pool, &key, &e, env);
        }
    }

    fn govern(
        &self,
        flow: &mut Flow,
        status: u16,
        headers: &Headers,
        body: &[u8],
        snap: &Snapshot,
        env: &mut Env,
    ) -> Option<Governed> {
        let Some(class) = classify::classify(status, body) else {
            self.answer_pace(flow, Answer::Other, env);
            return None;
        };
        let pool: &Pool = &self.cfg.pools[flow.pool];
        let provider = retry_after::provider_delay(headers, body, snap, pool.dialect, env.now());
        let provider_ms = provider.map(|(ms, _)| ms);
        let ra = &self.cfg.retry_after;
        let cd = &self.cfg.cooldown;
        let (counter, delay_ms, cool_ms, streak) = match class {
            Class::QuotaExhausted => {
                let base = provider_ms.unwrap_or(cd.quota_ms);
                let told = retry_after::told(base, base, ra, env.rng);
                (Counter::UpstreamQuotaExhausted, told, Some(cd.quota_ms), 0)
            }
            Class::RateLimited | Class::Overloaded => {
                let counter = if class == Class::RateLimited {
                    Counter::UpstreamRateLimited
                } else {
                    Counter::UpstreamOverloaded
                };
                // A round whose probe met another "not now" means the provider's time was too
                // short. With `escalate`, clients are told twice as long per failed round, so
                // they keep their retries for after the recovery; the probe itself still goes
                // at the provider's time (the cooldown deadline).
                let rounds = self.failed_rounds(flow, env);
                let stretch = self.stretch(rounds);
                match provider_ms {
                    Some(ms) => {
                        let told = retry_after::told(ms.saturating_mul(stretch), ms, ra, env.rng);
                        let cool = retry_after::sub_second_wait(headers, snap).unwrap_or(ms);
                        (counter, told, Some(cool.min(cd.max_ms)), rounds)
                    }
                    None => {
                        let told = retry_after::backoff(rounds.saturating_sub(1), ra, env.rng);
                        (counter, told, None, rounds)
                    }
                }
            }
        };
        env.metrics.count(flow.pool, counter);
        if class == Class::RateLimited {
            if let Some(d) = retry_after::exhausted_dimension(snap, body) {
                env.metrics.count(flow.pool, Counter::Exhausted(d));
            }
        }
        if cd.enabled {
            let wanted = cool_ms.map(|ms| Wanted { class, ms });
            // A 429 whose own headers still report requests left came from another limit
            // (concurrency, tokens): the pace after it must not trust `remaining`.
            let requests_left = snap.requests.remaining.is_some_and(|r| r > 0);
            self.cool(flow, wanted, streak, Answer::NotNow { requests_left }, env);
        } else {
            flow.released = false;
        }
        // Nothing is replayed, but the client's retry will be steered to a pool with room:
        // worth making at once, whatever this pool said.
        let steer_retry = cd.enabled && self.fallback_has_room(flow, env);
        let (delay_ms, should_retry) = if steer_retry {
            (FAILOVER_RETRY_MS, true)
        } else {
            (delay_ms, class.should_retry())
        };
        env.metrics
            .histogram(flow.pool, Histogram::RetryAfterMs, delay_ms);
        Some(Governed {
            class,
            delay_ms,
            provider_ms,
            headers: reply::retry_headers(class, AnswerSource::Upstream, delay_ms, should_retry),
        })
    }

    /// Merge an answer into the flow's (pool, account) record: the cooldown it asks for (if
    /// any), the streak, and what it means for the pace. Returns whether it started or moved
    /// a cooldown deadline.
    fn cool(
        &self,
        flow: &mut Flow,
        wanted: Option<Wanted>,
        streak: u8,
        answer: Answer,
        env: &mut Env,
    ) -> bool {
        let released = std::mem::take(&mut flow.released);
        let key = self.cooldown_key(flow);
        if !self.key_exists_or_admit(&key, keys::COOLDOWN_KEY_COUNT, flow.pool, env) {
            return false;
        }
        let now = env.now();
        let jitter = self.cfg.retry_after.jitter;
        let result = store::update(env.store, &key, None, |cur| {
            let old = cur.and_then(CooldownRecord::decode);
            let merged = cooldown::merge(old, wanted, streak, now, jitter);
            let next = cooldown::answered(merged, answer, released);
            let moved = old.map_or(0, |o| o.deadline_ms) != next.deadline_ms;
            let write = (old != Some(next)).then(|| next.encode().to_vec());
            (write, moved)
        });
        match result {
            Ok(u) => u.value,
            Err(e) => {
                self.store_failed(flow.pool, &key, &e, env);
                false
            }
        }
    }
}

/// Whether waiting for `a` ends sooner than waiting for `b`: a known wait beats an unknown
/// one (an unknown wait ends with an event that may never come soon), shorter beats longer.
fn frees_sooner(a: &Blocked, b: &Blocked) -> bool {
    match (a.holdable(), b.holdable()) {
        (true, false) => return true,
        (false, _) => return false,
        _ => {}
    }
    match (a.wait_ms(), b.wait_ms()) {
        (Some(x), Some(y)) => x < y,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Does a limit of this kind hold a slot for the whole stream?
pub(crate) fn holds_slot(kind: LimitKind) -> bool {
    kind == LimitKind::InFlight
}

/// The in-flight gauge moves with slots taken and given back.
pub(crate) fn in_flight_moved(env: &mut Env, pool: usize, delta: i64) {
    env.metrics.add(pool, Gauge::InFlight, delta);
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

fn export_gauges(pool: usize, snap: &Snapshot, metrics: &mut dyn Metrics) {
    let pairs = [
        (Gauge::RemainingRequests, snap.requests.remaining),
        (Gauge::RemainingTokens, snap.tokens.remaining),
        (Gauge::RemainingInputTokens, snap.input_tokens.remaining),
        (Gauge::RemainingOutputTokens, snap.output_tokens.remaining),
        (Gauge::LimitRequests, snap.requests.limit),
        (Gauge::LimitTokens, snap.tokens.limit),
        (Gauge::ResetRequestsMs, snap.requests.reset_ms),
        (Gauge::ResetTokensMs, snap.tokens.reset_ms),
    ];
    for (g, v) in pairs {
        if let Some(v) = v {
            metrics.gauge(pool, g, v);
        }
    }
}
