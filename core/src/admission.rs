//! Whether a request may go now: on its own pool, or on a fallback when the provider side says
//! "not now" or a cap is full; and why not when it cannot.

use crate::classify::Class;
use crate::cooldown::{self, Gate};
use crate::env::Env;
use crate::flow::Flow;
use crate::metrics::Counter;
use crate::policy::Governor;

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
        self.wait_ms().unwrap_or(0)
    }

    /// As it stands `elapsed` ms later: known waits shrink (to at least 1 ms).
    pub fn aged(self, elapsed: u64) -> Blocked {
        let shrink = |ms: u64| ms.saturating_sub(elapsed).max(1);
        match self {
            Blocked::Cooling {
                class,
                remaining_ms,
            } => Blocked::Cooling {
                class,
                remaining_ms: shrink(remaining_ms),
            },
            Blocked::Bucket {
                limit,
                wait_ms,
                remaining,
            } => Blocked::Bucket {
                limit,
                wait_ms: shrink(wait_ms),
                remaining,
            },
            Blocked::Paced { retry_in_ms } => Blocked::Paced {
                retry_in_ms: shrink(retry_in_ms),
            },
            Blocked::Quota { remaining_ms } => Blocked::Quota {
                remaining_ms: shrink(remaining_ms),
            },
            other => other,
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

impl Governor {
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
    pub(crate) fn admit_here(&self, flow: &mut Flow, env: &mut Env) -> Result<(), Blocked> {
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
        self.limits().take(flow, env).inspect_err(|_| {
            self.give_back_release(flow, env);
        })
    }

    /// What `flow` takes of the gate `blocked` names when its turn comes: its cost in the
    /// refused bucket (1 for a request limit, the reservation for a token budget); 0 for other
    /// gates, whose wait does not grow with the queue at a rate the gateway knows.
    pub fn cost_at(&self, blocked: &Blocked, flow: &Flow) -> u64 {
        match *blocked {
            Blocked::Bucket { limit, .. } => self.limits().cost(limit, flow),
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
                let per_minute = self
                    .cfg
                    .limits
                    .get(limit)
                    .map_or(1, |l| l.per_minute.max(1));
                let refill_ms = tokens.saturating_mul(60_000).div_ceil(per_minute);
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
                self.govern_as(&mut candidate, pool);
                self.has_room(&candidate, env)
            })
    }

    /// Whether the flow's pool could take it now, read-only: not cooling (nor out of quota),
    /// not pacing with no release open, no `max_in_flight` cap full. Request buckets are not
    /// looked at: they are the tenant's own limit wherever the request goes.
    pub(crate) fn has_room(&self, flow: &Flow, env: &mut Env) -> bool {
        if let Some(rec) = self.cooldown_record(flow, env) {
            let (gate, _) = cooldown::pass(rec, env.now(), self.cfg.hold.enabled());
            if !matches!(gate, Gate::Open | Gate::Released) {
                return false;
            }
        }
        self.limits().caps_have_room(flow, env)
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
