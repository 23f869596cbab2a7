//! What a response means, decided in one room: for the (pool, account) it came from (its
//! cooldown, its pace, the provider's gauges), for what the request took (a refund when the
//! provider counted nothing, usage to settle), and for what the client is told (the governed
//! headers, and that it was held or steered). Envoy's own answers (a reset, a timeout) are
//! told apart from the provider's here too.

use crate::admission::Admission;
use crate::classify::{self, Class};
use crate::config::{Config, Pool};
use crate::cooldown::{Answer, Wanted};
use crate::cooldowns::Cooldowns;
use crate::env::Env;
use crate::headers::Headers;
use crate::limits::Limits;
use crate::metrics::{Counter, Gauge, Histogram, Metrics};
use crate::predict;
use crate::ratelimit::{self, Snapshot};
use crate::reply::{self, AnswerSource, HELD_MS_HEADER};
use crate::request::{Flow, STEERING_HEADER};
use crate::retry_after;
use crate::usage::Usage;

/// What a client is told after an upstream "not now" when a fallback has room: come back at
/// once (its retry is steered there). A few ms rather than 0, which SDKs would not trust.
pub const FAILOVER_RETRY_MS: u64 = 5;

/// What an upstream "not now" tells its client and its (pool, account): the delay told, the
/// cooldown it asks for (none without a provider time: the backoff then spaces clients) and
/// the failed rounds it counts.
struct Told {
    delay_ms: u64,
    cool_ms: Option<u64>,
    streak: u8,
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
    /// Hold the headers: the class depends on the error body (`on_error_body`, or with none
    /// when the body cannot come).
    NeedBody,
    /// Rewrite the response headers and let it through.
    Rewrite(Governed),
}

/// What the response headers of a governed stream mean.
#[derive(Debug, PartialEq, Eq)]
pub struct Decision {
    /// What the client and the access log learn of a request that was steered or held.
    pub told: Vec<(&'static str, String)>,
    pub step: ResponseStep,
    /// Read the body: a success of a request that is charged its usage reports it there.
    pub scan_usage: bool,
    /// A success whose headers say the provider has nothing left started a cooldown (what a
    /// fleet learns from it: `fleet::watch`).
    pub cooled: bool,
}

/// The response side of a configuration.
#[derive(Clone, Copy)]
pub struct Responses<'a> {
    cfg: &'a Config,
    cooldowns: Cooldowns<'a>,
    limits: Limits<'a>,
    admission: Admission<'a>,
}

impl<'a> Responses<'a> {
    pub fn new(
        cfg: &'a Config,
        cooldowns: Cooldowns<'a>,
        limits: Limits<'a>,
        admission: Admission<'a>,
    ) -> Responses<'a> {
        Responses {
            cfg,
            cooldowns,
            limits,
            admission,
        }
    }

    /// The response headers of a request that went upstream arrived. Export the provider's
    /// rate-limit headers, start a preemptive cooldown when they say nothing is left, report
    /// to the pace, give back the reservations of an error the provider counted nothing for,
    /// and decide whether this is a governed response and whether its body is needed.
    /// `from_upstream` asks the host whether the response is the provider's or Envoy's own
    /// (asked only when it matters: a governed status or a refund).
    pub fn on_headers(
        &self,
        flow: &mut Flow,
        status: u16,
        headers: &Headers,
        end_of_stream: bool,
        from_upstream: &mut dyn FnMut() -> bool,
        env: &mut Env,
    ) -> Decision {
        let steered = (flow.pool != flow.home_pool)
            .then(|| (STEERING_HEADER, self.cfg.pools[flow.pool].name.clone()));
        let held = flow.held_ms.map(|ms| (HELD_MS_HEADER, ms.to_string()));
        let class = held
            .as_ref()
            .and_then(|_| reply::hold_class(self.cfg, flow));
        let told = steered.into_iter().chain(held).chain(class).collect();
        let scan_usage = flow.charged() && (200..300).contains(&status) && !end_of_stream;
        let governed = classify::is_governed_status(status);
        // An error the provider sent used no tokens: its reservations are given back. Envoy's
        // own errors (a reset, a timeout) say nothing of what the provider did: kept.
        let refund = status >= 400 && flow.reserves();
        let upstream = !(governed || refund) || from_upstream();
        if governed && !upstream {
            // Envoy's own 503 (upstream reset, connect failure, no healthy host) is not the
            // provider saying "not now": leave it ungoverned. The pace only learns that the
            // released request will not answer.
            self.cooldowns.answer_pace(flow, Answer::Other, env);
            let step = ResponseStep::Pass;
            return Decision {
                told,
                step,
                scan_usage: false,
                cooled: false,
            };
        }
        if refund && upstream {
            self.limits.refund(flow, env);
        }
        let snap = ratelimit::parse(headers, &|| env.now());
        export_gauges(flow.pool, &snap, env.metrics);
        let mut cooled = false;
        let step = if !governed {
            if (200..300).contains(&status) {
                cooled = self.on_success(flow, &snap, env);
            } else {
                self.cooldowns.answer_pace(flow, Answer::Other, env);
            }
            ResponseStep::Pass
        } else if classify::needs_body(status) && !end_of_stream {
            ResponseStep::NeedBody
        } else {
            self.govern(flow, status, headers, &[], &snap, env)
                .map_or(ResponseStep::Pass, ResponseStep::Rewrite)
        };
        Decision {
            told,
            step,
            scan_usage,
            cooled,
        }
    }

    /// The (bounded prefix of the) error body of a held response arrived, or none can come.
    pub fn on_error_body(
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
    pub fn on_stream_end(&self, flow: &mut Flow, usage: Option<Usage>, env: &mut Env) {
        self.limits.release_slots(flow, env);
        self.cooldowns.answer_pace(flow, Answer::Other, env);
        if let Some(usage) = usage {
            self.limits.on_usage(flow, &usage, env);
        }
    }

    /// A success: what it says of the provider's room. Returns whether it started (or moved)
    /// a cooldown.
    fn on_success(&self, flow: &mut Flow, snap: &Snapshot, env: &mut Env) -> bool {
        predict::on_success(self.cfg, flow, env);
        if flow.client_retry {
            env.metrics
                .count(flow.home_pool, Counter::SucceededAfterRetry);
        }
        if !self.cfg.cooldown.enabled {
            return false;
        }
        // A request that reserved tokens knows how many the next one like it needs, by
        // dimension: the provider's own remaining below it paces before any 429.
        let need = self.limits.need(flow);
        if self.cfg.preemptive {
            let wait = snap
                .short_wait_ms(&need)
                .map(|ms| since_release(flow, snap, ms, env));
            if let Some(reset) = wait.filter(|ms| *ms > 0) {
                let ms = reset.min(self.cfg.cooldown.max_ms);
                let wanted = Some(Wanted {
                    class: Class::RateLimited,
                    ms,
                });
                let answer = Answer::NotNow {
                    requests_left: false,
                };
                let moved = self.cooldowns.cool(flow, wanted, 0, answer, env);
                if moved {
                    env.metrics.count(flow.pool, Counter::PreemptiveCooldown);
                }
                return moved;
            }
        }
        if flow.released.is_some() || flow.streak > 0 {
            // The pace releases no more than the provider says fit: its remaining requests,
            // and its remaining tokens over what a request like this one needs.
            let answer = Answer::Success {
                remaining: snap.requests_that_fit(need.most()),
            };
            self.cooldowns.cool(flow, None, 0, answer, env);
        }
        false
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
            self.cooldowns.answer_pace(flow, Answer::Other, env);
            return None;
        };
        let pool: &Pool = &self.cfg.pools[flow.pool];
        let provider = retry_after::provider_delay(headers, body, snap, pool.dialect, env.now());
        let provider_ms = provider.map(|(ms, _)| ms);
        let ra = &self.cfg.retry_after;
        let cd = &self.cfg.cooldown;
        let counter = match class {
            Class::QuotaExhausted => Counter::UpstreamQuotaExhausted,
            Class::RateLimited => Counter::UpstreamRateLimited,
            Class::Overloaded => Counter::UpstreamOverloaded,
        };
        let Told {
            delay_ms,
            cool_ms,
            streak,
        } = match class {
            Class::QuotaExhausted => {
                let base = provider_ms.unwrap_or(cd.quota_ms);
                Told {
                    delay_ms: retry_after::told(base, base, ra, env.rng),
                    cool_ms: Some(cd.quota_ms),
                    streak: 0,
                }
            }
            Class::RateLimited | Class::Overloaded => {
                // A round whose probe met another "not now" means the provider's time was too
                // short. With `escalate`, clients are told twice as long per failed round, so
                // they keep their retries for after the recovery; the probe itself still goes
                // at the provider's time (the cooldown deadline).
                let rounds = self.cooldowns.failed_rounds(flow, env);
                let stretch = self.cooldowns.stretch(rounds);
                match provider_ms {
                    Some(stated) => {
                        // After a round whose probe met another "not now", the stated time has
                        // proved too short: where the provider's own reset of the exhausted
                        // dimension says later (a `retry-after: 1` through an outage whose
                        // window headers tell its true rest), the later time is believed.
                        let ms = match rounds {
                            0 | 1 => stated,
                            _ => retry_after::believed_ms(stated, snap),
                        };
                        let cool = retry_after::sub_second_wait(headers, snap).unwrap_or(ms);
                        Told {
                            delay_ms: retry_after::told(
                                ms.saturating_mul(stretch),
                                ms,
                                ra,
                                env.rng,
                            ),
                            cool_ms: Some(cool.min(cd.max_ms)),
                            streak: rounds,
                        }
                    }
                    None => Told {
                        delay_ms: retry_after::backoff(rounds.saturating_sub(1), ra, env.rng),
                        cool_ms: None,
                        streak: rounds,
                    },
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
            let answer = Answer::NotNow { requests_left };
            self.cooldowns.cool(flow, wanted, streak, answer, env);
        } else {
            flow.released = None;
        }
        // Nothing is replayed, but the client's retry will be steered to a pool with room:
        // worth making at once, whatever this pool said.
        let steer_retry = cd.enabled && self.admission.fallback_has_room(flow, env);
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
}

/// A wait the provider gave as a duration counts from when it took the request: for a request
/// the pace released, from its release plus [`TRANSIT_MS`]. Counted from the answer, each round
/// of a provider that answers slowly waited its whole latency more than the provider asked, every
/// round (a 500 ms latency used 80 % of the provider's pace at best). An instant (Anthropic's) is
/// left as is.
fn since_release(flow: &Flow, snap: &Snapshot, wait_ms: u64, env: &mut Env) -> u64 {
    match flow.released {
        Some(r) if snap.durations => {
            let taken_ms = env.now().saturating_sub(r.at_ms).saturating_sub(TRANSIT_MS);
            wait_ms.saturating_sub(taken_ms)
        }
        _ => wait_ms,
    }
}

/// How much later than its release the provider may have taken a request, at most, as far as a
/// duration's count is concerned. The provider counts the next request from its arrival, not its
/// release: counted from the bare release, a request whose way was slower than the next one's
/// reached a sliding window a millisecond before its slot freed (seen as one late 429 in about
/// one issue-3 storm in four). An answer quicker than this counts from the answer, as before.
const TRANSIT_MS: u64 = 20;

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
