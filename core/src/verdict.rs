//! What a response means for the (pool, account) it came from, and what the client is told.

use crate::classify::{self, Class};
use crate::config::Pool;
use crate::cooldown::{Answer, Wanted};
use crate::env::Env;
use crate::flow::Flow;
use crate::headers::Headers;
use crate::metrics::{Counter, Gauge, Histogram, Metrics};
use crate::policy::Governor;
use crate::ratelimit::{self, Snapshot};
use crate::reply::{self, AnswerSource};
use crate::retry_after;

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
    /// Hold the headers: the class depends on the error body.
    NeedBody,
    /// Rewrite the response headers and let it through.
    Rewrite(Governed),
}

impl Governor {
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
            self.limits().refund(flow, env);
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
        self.limits().release_slots(flow, env);
        self.answer_pace(flow, Answer::Other, env);
        if let Some(tokens) = usage {
            self.limits().on_usage(flow, tokens, env);
        }
    }

    /// Charge the tokens the provider reported to the flow's token budgets.
    pub fn on_usage(&self, flow: &mut Flow, tokens: u64, env: &mut Env) {
        self.limits().on_usage(flow, tokens, env);
    }

    pub(crate) fn on_success(&self, flow: &mut Flow, snap: &Snapshot, env: &mut Env) {
        if flow.client_retry {
            env.metrics
                .count(flow.home_pool, Counter::SucceededAfterRetry);
        }
        if !self.cfg.cooldown.enabled {
            return;
        }
        // A request that reserved tokens knows how many the next one like it needs.
        let need = flow
            .charges
            .iter()
            .map(|c| c.reserved)
            .max()
            .filter(|n| *n > 0);
        if self.cfg.preemptive {
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
            // The pace releases no more than the provider says fit: its remaining requests,
            // and its remaining tokens over what a request like this one needs.
            let answer = Answer::Success {
                remaining: snap.requests_that_fit(need),
            };
            self.cool(flow, None, 0, answer, env);
        }
    }

    pub(crate) fn govern(
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
                let rounds = self.failed_rounds(flow, env);
                let stretch = self.stretch(rounds);
                match provider_ms {
                    Some(ms) => {
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
