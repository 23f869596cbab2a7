//! Whether a request may go now: on its own pool, or on a fallback when the provider side says
//! "not now" or a cap is full; and why not when it cannot.

use crate::blocked::Blocked;
use crate::classify::Class;
use crate::config::Config;
use crate::cooldown::{self, Gate};
use crate::cooldowns::Cooldowns;
use crate::env::Env;
use crate::limits::Limits;
use crate::metrics::Counter;
use crate::pools::Pools;
use crate::request::Flow;

/// Admission over a configuration's pools, cooldowns and local limits.
#[derive(Clone, Copy)]
pub struct Admission<'a> {
    cfg: &'a Config,
    pools: Pools<'a>,
    cooldowns: Cooldowns<'a>,
    limits: Limits<'a>,
}

impl<'a> Admission<'a> {
    pub fn new(
        cfg: &'a Config,
        pools: Pools<'a>,
        cooldowns: Cooldowns<'a>,
        limits: Limits<'a>,
    ) -> Admission<'a> {
        Admission {
            cfg,
            pools,
            cooldowns,
            limits,
        }
    }

    /// Count a client retry (once per request, on its home pool).
    pub fn on_arrival(&self, flow: &Flow, env: &mut Env) {
        if flow.client_retry {
            env.metrics.count(flow.home_pool, Counter::ClientRetries);
        }
    }

    /// Whether the request may go now, on its own pool or, when that one's provider says "not
    /// now" or its cap is full, on the first of its fallbacks that can take it (failover comes
    /// before holding). On `Ok` the flow holds what it took and is governed as the pool it
    /// goes to. When no candidate can take it, the flow is left on the candidate that frees
    /// first (known waits first, the home pool on ties) and the error says why.
    pub fn admit(&self, flow: &mut Flow, env: &mut Env) -> Result<(), Blocked> {
        let home = flow.home_pool;
        if flow.pool != home {
            self.pools.govern_as(flow, home);
        }
        let blocked = match self.admit_here(flow, env) {
            Ok(()) => return Ok(()),
            Err(b) => b,
        };
        let fallback = &self.cfg.pools[home].fallback;
        if fallback.is_empty() || !blocked.steerable() {
            return Err(blocked);
        }
        let mut best = (home, blocked);
        for &pool in fallback {
            let mut candidate = flow.clone();
            self.pools.govern_as(&mut candidate, pool);
            match self.admit_here(&mut candidate, env) {
                Ok(()) => {
                    env.metrics.count(home, Counter::Failover);
                    *flow = candidate;
                    return Ok(());
                }
                Err(b) if b.frees_sooner_than(&best.1) => best = (pool, b),
                Err(_) => {}
            }
        }
        if best.0 != home {
            self.pools.govern_as(flow, best.0);
        }
        Err(best.1)
    }

    /// Admission on the flow's current pool alone.
    fn admit_here(&self, flow: &mut Flow, env: &mut Env) -> Result<(), Blocked> {
        if self.cfg.cooldown.enabled {
            match self.cooldowns.pass(flow, env) {
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
        self.limits.take(flow, env).inspect_err(|_| {
            self.cooldowns.give_back_release(flow, env);
        })
    }

    /// Give back what admission gave the flow: its local takes and the pace's release (the
    /// fleet refused it, or it is gone before the fleet answered).
    pub fn undo(&self, flow: &mut Flow, env: &mut Env) {
        self.limits.undo(flow, env);
        self.cooldowns.give_back_release(flow, env);
    }

    /// What `flow` takes of the gate `blocked` names when its turn comes: its cost in the
    /// refused bucket (1 for a request limit, the reservation for a token budget); 0 for other
    /// gates, whose wait does not grow with the queue at a rate the gateway knows.
    pub fn cost_at(&self, blocked: &Blocked, flow: &Flow) -> u64 {
        match *blocked {
            Blocked::Bucket { limit, .. } => self.limits.cost(limit, flow),
            _ => 0,
        }
    }

    /// `blocked` for a request behind others: `tokens` more of the refused bucket must refill
    /// first (at its configured rate) before its turn comes.
    pub fn later_by(&self, blocked: Blocked, tokens: u64) -> Blocked {
        match blocked {
            Blocked::Bucket {
                limit,
                wait_ms,
                remaining,
            } if tokens > 0 => {
                let (per_window, window_ms) = self
                    .cfg
                    .limits
                    .get(limit)
                    .map_or((1, 60_000), |l| (l.per_window.max(1), l.window_ms()));
                let refill_ms = tokens.saturating_mul(window_ms).div_ceil(per_window);
                Blocked::Bucket {
                    limit,
                    wait_ms: wait_ms.saturating_add(refill_ms),
                    remaining,
                }
            }
            other => other,
        }
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
                self.pools.govern_as(&mut candidate, pool);
                self.has_room(&candidate, env)
            })
    }

    /// Whether the flow's pool could take it now, read-only: not cooling (nor out of quota),
    /// not pacing with no release open, no `max_in_flight` cap full. Request buckets are not
    /// looked at: they are the tenant's own limit wherever the request goes.
    fn has_room(&self, flow: &Flow, env: &mut Env) -> bool {
        if let Some(rec) = self.cooldowns.record(flow, env) {
            let (gate, _) = cooldown::pass(rec, env.now(), self.cfg.hold.enabled());
            if !matches!(gate, Gate::Open | Gate::Released) {
                return false;
            }
        }
        self.limits.caps_have_room(flow, env)
    }
}
