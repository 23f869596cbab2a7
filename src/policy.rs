//! The decisions: what to do with a request, and what to tell the client about a response.
//!
//! The shared store, the metrics sink and the randomness come in as traits and `now` as a
//! value, so every path is driven natively in tests exactly as the host drives it.

use crate::bucket::{Bucket, Shape, Take};
use crate::classify::{self, Class, Dialect};
use crate::config::{Config, LimitKey, LimitKind, Pool};
use crate::headers::Headers;
use crate::keys;
use crate::metrics::{Counter, Gauge, Metrics};
use crate::ratelimit::{self, Snapshot};
use crate::reply::{self, AnswerSource, LimitFields, LocalReply};
use crate::retry_after::{self, Random};
use crate::store::{self, SharedStore, UpdateError};

/// What the host hands the policy for every call. Trait objects rather than generics: one
/// indirect call per store or metrics operation is nothing next to a hostcall, and the policy
/// reads as plain code.
pub struct Env<'a> {
    pub store: &'a dyn SharedStore,
    pub metrics: &'a mut dyn Metrics,
    pub rng: &'a mut dyn Random,
    pub now_ms: u64,
}

/// The parts of a request the policy looks at.
pub struct RequestView<'a> {
    pub path: &'a [u8],
    pub authority: &'a [u8],
    pub headers: Headers<'a>,
}

/// What the request path learned, carried to the response path of the same stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flow {
    pub pool: usize,
    pub account: u64,
    /// The dialect for locally generated bodies (`auto` resolved from the request).
    pub dialect: Dialect,
    /// Consecutive failed cooldown rounds of this (pool, account), read with its cooldown:
    /// a success resets them.
    pub streak: u8,
    /// Token buckets to charge with the response's usage: (limit index, shared-data key).
    pub charges: Vec<(usize, String)>,
}

#[derive(Debug)]
pub enum RequestDecision {
    Forward(Flow),
    Reply(Flow, LocalReply),
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

/// A cooldown as stored in shared data: 18 fixed-width bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CooldownRecord {
    /// Until when the provider said "not now", Unix ms (0: not cooling).
    pub deadline_ms: u64,
    /// The provider's time in the answer that set the deadline.
    pub period_ms: u32,
    /// What returning clients are spread over: a fraction of the longest period of the
    /// episode this cooldown belongs to.
    pub spread_ms: u32,
    pub class: Class,
    pub streak: u8,
}

impl CooldownRecord {
    const LEN: usize = 18;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[..8].copy_from_slice(&self.deadline_ms.to_le_bytes());
        out[8..12].copy_from_slice(&self.period_ms.to_le_bytes());
        out[12..16].copy_from_slice(&self.spread_ms.to_le_bytes());
        out[16] = self.class.to_byte();
        out[17] = self.streak;
        out
    }

    pub fn decode(b: &[u8]) -> Option<CooldownRecord> {
        if b.len() != Self::LEN {
            return None;
        }
        Some(CooldownRecord {
            deadline_ms: u64::from_le_bytes(b[..8].try_into().ok()?),
            period_ms: u32::from_le_bytes(b[8..12].try_into().ok()?),
            spread_ms: u32::from_le_bytes(b[12..16].try_into().ok()?),
            class: Class::from_byte(b[16])?,
            streak: b[17],
        })
    }
}

pub struct Governor {
    pub cfg: Config,
    /// Per pool: the id of its name, for `key: pool` limits.
    pool_ids: Vec<u64>,
}

impl Governor {
    pub fn new(cfg: Config) -> Governor {
        let pool_ids = cfg
            .pools
            .iter()
            .map(|p| keys::fnv1a64(p.name.as_bytes()))
            .collect();
        Governor { cfg, pool_ids }
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
            .map_or(keys::NO_ACCOUNT, keys::fnv1a64)
    }

    pub fn on_request(&self, req: &RequestView, env: &mut Env) -> RequestDecision {
        let pool = self.pool_for(req);
        let mut flow = Flow {
            pool,
            account: self.account_of(&req.headers),
            dialect: self.cfg.pools[pool]
                .dialect
                .resolve_for_request(req.path, &req.headers),
            streak: 0,
            charges: Vec::new(),
        };
        if self.cfg.cooldown.enabled {
            if let Some(reply) = self.answer_from_cooldown(&mut flow, env) {
                return RequestDecision::Reply(flow, reply);
            }
        }
        for (i, limit) in self.cfg.limits.iter().enumerate() {
            let key_id = match &limit.key {
                LimitKey::Header(name) => keys::fnv1a64(req.headers.get(name).unwrap_or(b"-")),
                LimitKey::Account => flow.account,
                LimitKey::Pool => self.pool_ids[pool],
            };
            let Some((key, take)) = self.take(i, key_id, pool, env) else {
                continue;
            };
            if limit.kind == LimitKind::Tokens {
                flow.charges.push((i, key));
            }
            if !take.admitted {
                let delay = take.wait_ms.clamp(1, self.cfg.retry_after.max_ms);
                let fields = LimitFields {
                    name: limit.name.clone(),
                    quota: limit.per_minute,
                    window_s: 60,
                    remaining: take.remaining,
                    reset_s: take.wait_ms.div_ceil(1000),
                };
                env.metrics.count(pool, Counter::LocalRejectLimit);
                env.metrics.retry_after(pool, delay);
                let reply = reply::local_reply(
                    flow.dialect,
                    Class::RateLimited,
                    AnswerSource::Limit,
                    delay,
                    Some(&fields),
                );
                return RequestDecision::Reply(flow, reply);
            }
        }
        RequestDecision::Forward(flow)
    }

    /// Charge the flow's token budgets with the tokens its response used.
    pub fn on_usage(&self, flow: &Flow, tokens: u64, env: &mut Env) {
        let now = env.now_ms;
        for (i, key) in &flow.charges {
            let shape = self.cfg.limits[*i].shape();
            let result = update_bucket(env, key, None, shape, |b| {
                (Some(b.charge(shape, now, tokens)), ())
            });
            if let Err(e) = result {
                self.store_failed(flow.pool, key, &e, env);
            }
        }
    }

    fn cooldown_record(&self, flow: &Flow, env: &Env) -> Option<CooldownRecord> {
        let key = keys::cooldown_key(&self.cfg.pools[flow.pool].name, flow.account);
        let (bytes, _) = env.store.get(&key).ok().flatten()?;
        CooldownRecord::decode(&bytes)
    }

    /// Consecutive rounds that ended in "not now", counting this answer. Answers that arrive
    /// while a cooldown is running belong to its round; one that arrives after it ended, with
    /// no success since, starts the next round.
    fn failed_rounds(&self, flow: &Flow, env: &Env) -> u8 {
        match self.cooldown_record(flow, env) {
            Some(r) if r.deadline_ms > env.now_ms => r.streak.max(1),
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

    fn answer_from_cooldown(&self, flow: &mut Flow, env: &mut Env) -> Option<LocalReply> {
        let rec = self.cooldown_record(flow, env)?;
        flow.streak = rec.streak;
        let remaining = rec
            .deadline_ms
            .checked_sub(env.now_ms)
            .filter(|ms| *ms > 0)?;
        // After failed rounds (with `escalate`), clients wait the extra periods the upstream
        // answers told them. The jitter is a fraction of the whole period, not of what is
        // left: clients answered late in a cooldown would otherwise all come back within a few
        // milliseconds of the deadline and collide there.
        let extra = self.stretch(rec.streak) - 1;
        let wait = remaining.saturating_add(u64::from(rec.period_ms).saturating_mul(extra));
        let spread = u64::from(rec.spread_ms);
        let delay = retry_after::told(wait, spread, &self.cfg.retry_after, env.rng);
        let counter = if rec.class == Class::QuotaExhausted {
            Counter::LocalRejectQuota
        } else {
            Counter::LocalRejectCooldown
        };
        env.metrics.count(flow.pool, counter);
        env.metrics.retry_after(flow.pool, delay);
        Some(reply::local_reply(
            flow.dialect,
            rec.class,
            AnswerSource::Cooldown,
            delay,
            None,
        ))
    }

    /// Take one request from the bucket of (limit, key), or, for a token budget, check that
    /// tokens are left. Returns the bucket's key and the decision; None when shared data could
    /// not be updated: the request is then admitted (fail-open) and `store_contention` counts
    /// it, so the governor never rejects traffic because of its own bookkeeping.
    fn take(
        &self,
        limit: usize,
        key_id: u64,
        pool: usize,
        env: &mut Env,
    ) -> Option<(String, Take)> {
        let limit = &self.cfg.limits[limit];
        let shape = limit.shape();
        let mut key = keys::bucket_key(&limit.name, key_id);
        let known = env.store.get(&key).ok().flatten();
        if known.is_none() && !self.admit_new_key(keys::BUCKET_KEY_COUNT, pool, env) {
            key = keys::overflow_bucket_key(&limit.name);
        }
        let now = env.now_ms;
        let result = update_bucket(env, &key, known, shape, |b| match limit.kind {
            LimitKind::Requests => {
                let (after, take) = b.take(shape, now, 1);
                ((after != b).then_some(after), take)
            }
            LimitKind::Tokens => (None, b.check(shape, now, 1)),
        });
        match result {
            Ok(u) => Some((key, u.value)),
            Err(e) => {
                self.store_failed(pool, &key, &e, env);
                None
            }
        }
    }

    fn store_failed(&self, pool: usize, key: &str, e: &UpdateError, env: &mut Env) {
        env.metrics.count(pool, Counter::StoreContention);
        if let UpdateError::Host(msg) = e {
            log::warn!(
                "llm_governor: shared data update of {key} failed ({msg}); admitting the request"
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
    fn admit_new_key(&self, count_key: &str, pool: usize, env: &mut Env) -> bool {
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
    /// preemptive cooldown when they say nothing is left, and decide whether this is a
    /// governed response and whether its body is needed.
    pub fn on_response_headers(
        &self,
        flow: &Flow,
        status: u16,
        headers: &Headers,
        end_of_stream: bool,
        body_available: bool,
        env: &mut Env,
    ) -> ResponseStep {
        let snap = ratelimit::parse(headers, env.now_ms);
        export_gauges(flow.pool, &snap, env.metrics);
        if !classify::is_governed_status(status) {
            if (200..300).contains(&status) {
                self.on_success(flow, &snap, env);
            }
            return ResponseStep::Pass;
        }
        if classify::needs_body(status) && !end_of_stream && body_available {
            return ResponseStep::NeedBody;
        }
        self.govern(flow, status, headers, &[], &snap, env)
            .map_or(ResponseStep::Pass, ResponseStep::Rewrite)
    }

    /// The (bounded prefix of the) error body of a held response arrived.
    pub fn on_response_body(
        &self,
        flow: &Flow,
        status: u16,
        headers: &Headers,
        body: &[u8],
        env: &mut Env,
    ) -> Option<Governed> {
        let snap = ratelimit::parse(headers, env.now_ms);
        self.govern(flow, status, headers, body, &snap, env)
    }

    fn on_success(&self, flow: &Flow, snap: &Snapshot, env: &mut Env) {
        if !self.cfg.cooldown.enabled {
            return;
        }
        if self.cfg.preemptive {
            if let Some(reset) = snap.exhausted_reset_ms().filter(|ms| *ms > 0) {
                let ms = reset.min(self.cfg.cooldown.max_ms);
                if self.cool(flow, Class::RateLimited, Some(ms), 0, env) {
                    env.metrics.count(flow.pool, Counter::PreemptiveCooldown);
                }
                return;
            }
        }
        if flow.streak > 0 {
            self.cool(flow, Class::RateLimited, None, 0, env);
        }
    }

    fn govern(
        &self,
        flow: &Flow,
        status: u16,
        headers: &Headers,
        body: &[u8],
        snap: &Snapshot,
        env: &mut Env,
    ) -> Option<Governed> {
        let class = classify::classify(status, body)?;
        let pool: &Pool = &self.cfg.pools[flow.pool];
        let provider = retry_after::provider_delay(headers, body, snap, pool.dialect, env.now_ms);
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
        env.metrics.retry_after(flow.pool, delay_ms);
        if cd.enabled {
            self.cool(flow, class, cool_ms, streak, env);
        }
        Some(Governed {
            class,
            delay_ms,
            provider_ms,
            headers: reply::governed_headers(class, AnswerSource::Upstream, delay_ms),
        })
    }

    /// Record a cooldown of `ms` for the flow's (pool, account), keeping any later deadline,
    /// and the backoff streak. Returns whether shared data was written.
    fn cool(&self, flow: &Flow, class: Class, ms: Option<u64>, streak: u8, env: &mut Env) -> bool {
        let key = keys::cooldown_key(&self.cfg.pools[flow.pool].name, flow.account);
        if !self.key_exists_or_admit(&key, keys::COOLDOWN_KEY_COUNT, flow.pool, env) {
            return false;
        }
        let now = env.now_ms;
        let wanted = ms.map(|ms| CooldownRecord {
            deadline_ms: now.saturating_add(ms),
            period_ms: u32::try_from(ms).unwrap_or(u32::MAX),
            spread_ms: u32::try_from(ms).unwrap_or(u32::MAX),
            class,
            streak,
        });
        let jitter = self.cfg.retry_after.jitter;
        let result = store::update(env.store, &key, None, |cur| {
            let old = cur.and_then(CooldownRecord::decode);
            let next = match (old, wanted) {
                // Re-cooling keeps the later deadline, never the shorter.
                (Some(o), Some(w)) if o.deadline_ms >= w.deadline_ms => {
                    CooldownRecord { streak, ..o }
                }
                // Except for the answers of one burst: they arrive over tens or hundreds of
                // milliseconds, each with the same "N s from now", and clients were already
                // told N s plus up to `jitter` of it. Moving the deadline by less than that
                // band would only answer locally the clients that come back on time, after the
                // provider has recovered. A different time is a different statement and moves
                // the deadline as usual.
                (Some(o), Some(w))
                    if o.deadline_ms > now
                        && o.class == w.class
                        && o.period_ms == w.period_ms
                        && (w.deadline_ms - o.deadline_ms) as f64
                            <= f64::from(o.period_ms) * jitter =>
                {
                    CooldownRecord { streak, ..o }
                }
                // A new cooldown soon after the previous one ended is part of the same episode
                // (a window reopening a slot at a time): it keeps the episode's longest period,
                // so clients answered locally in a short cooldown (tens of ms until the next
                // slot) are still spread over a fraction of the episode's period rather than
                // all sent back within a few milliseconds to collide at the next slot.
                (Some(o), Some(w))
                    if o.class == w.class
                        && o.deadline_ms.saturating_add(u64::from(o.spread_ms)) > now =>
                {
                    CooldownRecord {
                        spread_ms: w.spread_ms.max(o.spread_ms),
                        ..w
                    }
                }
                (_, Some(w)) => w,
                (Some(o), None) => CooldownRecord { streak, ..o },
                (None, None) => CooldownRecord {
                    deadline_ms: 0,
                    period_ms: 0,
                    spread_ms: 0,
                    class,
                    streak,
                },
            };
            let write = (old != Some(next)).then(|| next.encode().to_vec());
            (write, ())
        });
        match result {
            Ok(_) => true,
            Err(e) => {
                self.store_failed(flow.pool, &key, &e, env);
                false
            }
        }
    }
}

/// Read-modify-write the token bucket at `key`, created full when missing (a stored value
/// that is not a bucket reads as a full one). `step` returns the bucket to write, if any.
fn update_bucket<T>(
    env: &Env,
    key: &str,
    known: Option<(Vec<u8>, u32)>,
    shape: Shape,
    mut step: impl FnMut(Bucket) -> (Option<Bucket>, T),
) -> Result<store::Updated<T>, UpdateError> {
    let now = env.now_ms;
    let init = Bucket::full(shape, now).encode();
    store::update_from(env.store, key, known, Some(&init), |cur| {
        let b = cur
            .and_then(Bucket::decode)
            .unwrap_or_else(|| Bucket::full(shape, now));
        let (write, value) = step(b);
        (write.map(|b| b.encode().to_vec()), value)
    })
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
        && m.header
            .as_ref()
            .map_or(true, |(n, v)| req.headers.get(n) == Some(v.as_bytes()))
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
