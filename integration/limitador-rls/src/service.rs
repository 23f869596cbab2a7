//! The gRPC services: Envoy's `envoy.service.ratelimit.v3.RateLimitService` and Kuadrant's
//! `kuadrant.service.ratelimit.v1.RateLimitService`, answering as `limitador-server` does.
//!
//! - namespace = the request's `domain`; an empty domain is answered `UNKNOWN` untouched;
//! - the CEL context is the `descriptors` list binding ([`crate::context`]);
//! - ShouldRateLimit adds the request's `hits_addend` (0 means 1) when no limit is exceeded,
//!   answers `OK` or `OVER_LIMIT` with `statuses: []`, and, with `--rate-limit-headers
//!   DRAFT_VERSION_03`, `X-RateLimit-Limit/-Remaining/-Reset` in `response_headers_to_add`
//!   (sorted by name) from the crate's `CheckResult::response_header()`;
//! - any error of the limiter (the storage) is gRPC `UNAVAILABLE`, so Envoy's
//!   `failure_mode_deny` decides, never `UNKNOWN` (which Envoy lets through).

// tonic's handlers return `Result<_, tonic::Status>`; Status is large by design.
#![allow(clippy::result_large_err)]

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use limitador::errors::LimitadorError;
use limitador::limit::Namespace;
use limitador::reservation::ReservationId;
use limitador::CheckResult;
use tonic::{Request, Response, Status};

use crate::context::{descriptors_context, hits_addend};
use crate::fault::{faults, Answer};
use crate::limiter::Limiter;
use crate::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService as EnvoyRls;
use crate::pb::kuadrant::service::ratelimit::v1::rate_limit_service_server::RateLimitService as KuadrantRls;
use crate::pb::{
    Code, CommitRequest, CommitResponse, HeaderValue, RateLimitRequest, RateLimitResponse,
    ReserveRequest, ReserveResponse,
};

/// `--rate-limit-headers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateLimitHeaders {
    None,
    DraftVersion03,
}

impl RateLimitHeaders {
    pub fn parse(s: &str) -> Option<RateLimitHeaders> {
        match s {
            "NONE" => Some(RateLimitHeaders::None),
            "DRAFT_VERSION_03" => Some(RateLimitHeaders::DraftVersion03),
            _ => None,
        }
    }

    /// The headers of a check's result, sorted by name.
    pub fn headers(self, result: &mut CheckResult) -> Vec<HeaderValue> {
        let mut headers: Vec<HeaderValue> = match self {
            RateLimitHeaders::None => Vec::new(),
            RateLimitHeaders::DraftVersion03 => result
                .response_header()
                .into_iter()
                .map(|(key, value)| HeaderValue { key, value })
                .collect(),
        };
        headers.sort_by(|a, b| a.key.cmp(&b.key));
        headers
    }
}

/// Both services over one limiter.
#[derive(Clone)]
pub struct Rls {
    limiter: Arc<Limiter>,
    headers: RateLimitHeaders,
    /// The most one call into the limiter may take before it is answered `UNAVAILABLE`.
    deadline: Duration,
}

impl Rls {
    pub fn new(limiter: Arc<Limiter>, headers: RateLimitHeaders, deadline: Duration) -> Rls {
        Rls {
            limiter,
            headers,
            deadline,
        }
    }

    /// Runs one call into the limiter: an error (or no answer within the deadline) is
    /// `UNAVAILABLE`; a panic inside the crate (a condition that fails to evaluate, e.g. an
    /// index past the descriptors sent) is `INTERNAL`.
    async fn guard<T>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, LimitadorError>>,
    ) -> Result<T, Status> {
        match tokio::time::timeout(self.deadline, AssertUnwindSafe(call).catch_unwind()).await {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => {
                eprintln!("limitador-rls: {what}: {e}");
                Err(Status::unavailable("Service unavailable"))
            }
            Ok(Err(_panic)) => {
                eprintln!("limitador-rls: {what}: the limiter panicked");
                Err(Status::internal("a limit failed to evaluate"))
            }
            Err(_elapsed) => {
                eprintln!(
                    "limitador-rls: {what}: no answer from the storage within {} ms",
                    self.deadline.as_millis()
                );
                Err(Status::unavailable("Service unavailable"))
            }
        }
    }
}

/// The injected `UNAVAILABLE`, if `--answer unavailable`.
fn injected() -> Result<(), Status> {
    if faults().answer() == Answer::Unavailable {
        Err(Status::unavailable("fault injected: --answer unavailable"))
    } else {
        Ok(())
    }
}

/// `injected()`, and the injected `UNIMPLEMENTED` of `Reserve` and `Commit` with
/// `--answer no-reservations`.
fn injected_reservations() -> Result<(), Status> {
    if faults().answer() == Answer::NoReservations {
        return Err(Status::unimplemented(
            "fault injected: --answer no-reservations",
        ));
    }
    injected()
}

/// Every answer, success or error, leaves after the injected delay.
async fn answer<T>(result: Result<T, Status>) -> Result<Response<T>, Status> {
    faults().wait().await;
    result.map(Response::new)
}

fn response(code: Code, headers: Vec<HeaderValue>) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: code as i32,
        statuses: Vec::new(),
        response_headers_to_add: headers,
    }
}

impl Rls {
    async fn should(&self, req: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        injected()?;
        if req.domain.is_empty() {
            return Ok(response(Code::Unknown, Vec::new()));
        }
        let ns = Namespace::from(req.domain);
        let ctx = descriptors_context(&req.descriptors);
        let delta = hits_addend(req.hits_addend);
        let mut result = self
            .guard(
                "ShouldRateLimit",
                self.limiter.check_rate_limited_and_update(&ns, &ctx, delta),
            )
            .await?;
        let code = if result.limited {
            Code::OverLimit
        } else {
            Code::Ok
        };
        Ok(response(code, self.headers.headers(&mut result)))
    }

    async fn check(&self, req: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        if faults().answer() == Answer::NoCheck {
            return Err(Status::unimplemented("fault injected: --answer no-check"));
        }
        injected()?;
        if req.domain.is_empty() {
            return Ok(response(Code::Unknown, Vec::new()));
        }
        let ns = Namespace::from(req.domain);
        let ctx = descriptors_context(&req.descriptors);
        // Limitador's CheckRateLimit checks a delta of 1, whatever hits_addend says.
        let result = self
            .guard("CheckRateLimit", self.limiter.is_rate_limited(&ns, &ctx, 1))
            .await?;
        let code = if result.limited {
            Code::OverLimit
        } else {
            Code::Ok
        };
        Ok(response(code, Vec::new()))
    }

    async fn report(&self, req: RateLimitRequest) -> Result<RateLimitResponse, Status> {
        injected()?;
        if req.domain.is_empty() {
            return Ok(response(Code::Unknown, Vec::new()));
        }
        let ns = Namespace::from(req.domain);
        let ctx = descriptors_context(&req.descriptors);
        let delta = hits_addend(req.hits_addend);
        self.guard("Report", self.limiter.update_counters(&ns, &ctx, delta))
            .await?;
        Ok(response(Code::Ok, Vec::new()))
    }

    async fn reserve_(&self, req: ReserveRequest) -> Result<ReserveResponse, Status> {
        injected_reservations()?;
        if req.domain.is_empty() {
            return Ok(ReserveResponse {
                code: Code::Unknown as i32,
                reservation_id: String::new(),
            });
        }
        let ns = Namespace::from(req.domain);
        let ctx = descriptors_context(&req.descriptors);
        // No ttl, or one that is negative or out of range: the server's maximum.
        let ttl = req.ttl.and_then(|d| Duration::try_from(d).ok());
        let result = self
            .guard("Reserve", self.limiter.reserve(&ns, &ctx, req.amount, ttl))
            .await?;
        Ok(if result.limited {
            ReserveResponse {
                code: Code::OverLimit as i32,
                reservation_id: String::new(),
            }
        } else {
            ReserveResponse {
                code: Code::Ok as i32,
                reservation_id: result
                    .reservation_id
                    .map(|id| id.to_string())
                    .unwrap_or_default(),
            }
        })
    }

    async fn commit_(&self, req: CommitRequest) -> Result<CommitResponse, Status> {
        injected_reservations()?;
        if req.domain.is_empty() {
            return Ok(CommitResponse {
                reservation_released: false,
            });
        }
        let ns = Namespace::from(req.domain);
        let ctx = descriptors_context(&req.descriptors);
        let id = (!req.reservation_id.is_empty()).then(|| ReservationId::from(req.reservation_id));
        let result = self
            .guard(
                "Commit",
                self.limiter
                    .commit_reservation(&ns, &ctx, id.as_ref(), req.actual_amount),
            )
            .await?;
        Ok(CommitResponse {
            reservation_released: result.reservation_released,
        })
    }
}

#[tonic::async_trait]
impl EnvoyRls for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        answer(self.should(request.into_inner()).await).await
    }
}

#[tonic::async_trait]
impl KuadrantRls for Rls {
    async fn check_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        answer(self.check(request.into_inner()).await).await
    }

    async fn report(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        answer(Rls::report(self, request.into_inner()).await).await
    }

    async fn reserve(
        &self,
        request: Request<ReserveRequest>,
    ) -> Result<Response<ReserveResponse>, Status> {
        answer(self.reserve_(request.into_inner()).await).await
    }

    async fn commit(
        &self,
        request: Request<CommitRequest>,
    ) -> Result<Response<CommitResponse>, Status> {
        answer(self.commit_(request.into_inner()).await).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::parse_limits;
    use crate::pb::descriptor;
    use limitador::reservation::ReservationLimits;
    use tonic::IntoRequest;

    const LIMITS: &str = r#"
- namespace: ns
  max_value: 3
  seconds: 60
  name: per-account
  conditions: ["descriptors[0].kind == 'req'"]
  variables: ["descriptors[0].account"]
- namespace: ns
  max_value: 100
  seconds: 60
  conditions: ["descriptors[0].kind == 'tok'"]
  variables: ["descriptors[0].account"]
"#;

    async fn rls(headers: RateLimitHeaders) -> Rls {
        let limiter = Limiter::memory(ReservationLimits {
            max_fraction: 0.5,
            max_ttl: Duration::from_secs(60),
        });
        limiter
            .configure_with(parse_limits(LIMITS).unwrap())
            .await
            .unwrap();
        Rls::new(Arc::new(limiter), headers, Duration::from_secs(1))
    }

    fn req(domain: &str, kind: &str, hits: u32) -> Request<RateLimitRequest> {
        RateLimitRequest {
            domain: domain.into(),
            descriptors: vec![descriptor([("kind", kind), ("account", "a")])],
            hits_addend: hits,
        }
        .into_request()
    }

    fn headers(resp: &RateLimitResponse) -> Vec<(String, String)> {
        resp.response_headers_to_add
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect()
    }

    #[tokio::test]
    async fn ok_then_over_limit_with_draft_03_headers() {
        let s = rls(RateLimitHeaders::DraftVersion03).await;
        let r = s.should_rate_limit(req("ns", "req", 2)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(r.statuses.is_empty());
        let h = headers(&r);
        assert_eq!(h[0].0, "X-RateLimit-Limit");
        assert_eq!(h[0].1, "3, 3;w=60;name=\"per-account\"");
        assert_eq!(h[1], ("X-RateLimit-Remaining".into(), "1".into()));
        assert_eq!(h[2].0, "X-RateLimit-Reset");
        // 0 means 1: the third hit fits, the fourth does not.
        let r = s.should_rate_limit(req("ns", "req", 0)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        let r = s.should_rate_limit(req("ns", "req", 1)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        assert_eq!(headers(&r)[1], ("X-RateLimit-Remaining".into(), "0".into()));
    }

    #[tokio::test]
    async fn no_headers_by_default_and_no_limit_is_ok() {
        let s = rls(RateLimitHeaders::None).await;
        let r = s.should_rate_limit(req("ns", "req", 1)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(r.response_headers_to_add.is_empty());
        let r = s.should_rate_limit(req("other", "req", 9)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
    }

    #[tokio::test]
    async fn empty_domain_is_unknown() {
        let s = rls(RateLimitHeaders::DraftVersion03).await;
        let r = s.should_rate_limit(req("", "req", 1)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Unknown as i32);
        let r = s.check_rate_limit(req("", "req", 1)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Unknown as i32);
    }

    #[tokio::test]
    async fn check_never_charges_report_always_does() {
        let s = rls(RateLimitHeaders::None).await;
        for _ in 0..5 {
            let r = s.check_rate_limit(req("ns", "req", 50)).await.unwrap().into_inner();
            assert_eq!(r.overall_code, Code::Ok as i32);
        }
        let r = KuadrantRls::report(&s, req("ns", "req", 7)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::Ok as i32);
        let r = s.check_rate_limit(req("ns", "req", 1)).await.unwrap().into_inner();
        assert_eq!(r.overall_code, Code::OverLimit as i32);
    }

    fn reserve_req(amount: u64, ttl_ms: Option<i64>) -> Request<ReserveRequest> {
        ReserveRequest {
            domain: "ns".into(),
            descriptors: vec![descriptor([("kind", "tok"), ("account", "a")])],
            amount,
            ttl: ttl_ms.map(|ms| prost_types::Duration {
                seconds: ms / 1000,
                nanos: ((ms % 1000) * 1_000_000) as i32,
            }),
        }
        .into_request()
    }

    fn commit_req(id: &str, actual: u64) -> Request<CommitRequest> {
        CommitRequest {
            domain: "ns".into(),
            descriptors: vec![descriptor([("kind", "tok"), ("account", "a")])],
            reservation_id: id.into(),
            actual_amount: actual,
        }
        .into_request()
    }

    #[tokio::test]
    async fn reserve_holds_and_commit_settles() {
        let s = rls(RateLimitHeaders::None).await;
        // Admission is on the amount asked (80 <= 100); the hold is clamped to 50 (fraction 0.5).
        let r = s.reserve(reserve_req(80, Some(30_000))).await.unwrap().into_inner();
        assert_eq!(r.code, Code::Ok as i32);
        assert!(!r.reservation_id.is_empty());
        // 50 held: 60 more does not fit, 50 does.
        let r2 = s.reserve(reserve_req(60, None)).await.unwrap().into_inner();
        assert_eq!(r2.code, Code::OverLimit as i32);
        assert!(r2.reservation_id.is_empty());
        let r3 = s.reserve(reserve_req(50, None)).await.unwrap().into_inner();
        assert_eq!(r3.code, Code::Ok as i32);
        // Settle the first at 30: its hold goes, 30 is counted.
        let c = s.commit(commit_req(&r.reservation_id, 30)).await.unwrap().into_inner();
        assert!(c.reservation_released);
        // A second commit of the same id finds no hold: it degrades to a report.
        let c = s.commit(commit_req(&r.reservation_id, 1)).await.unwrap().into_inner();
        assert!(!c.reservation_released);
        // value 31 + held 50 = 81: 19 fits, 20 does not.
        let r4 = s.reserve(reserve_req(20, None)).await.unwrap().into_inner();
        assert_eq!(r4.code, Code::OverLimit as i32);
        let r5 = s.reserve(reserve_req(19, None)).await.unwrap().into_inner();
        assert_eq!(r5.code, Code::Ok as i32);
    }

    #[tokio::test]
    async fn reserve_without_a_matching_limit_is_ok_without_an_id() {
        let s = rls(RateLimitHeaders::None).await;
        let mut q = reserve_req(10, None);
        q.get_mut().domain = "nobody".into();
        let r = s.reserve(q).await.unwrap().into_inner();
        assert_eq!(r.code, Code::Ok as i32);
        assert!(r.reservation_id.is_empty());
        let mut q = reserve_req(10, None);
        q.get_mut().domain = String::new();
        let r = s.reserve(q).await.unwrap().into_inner();
        assert_eq!(r.code, Code::Unknown as i32);
    }

    #[tokio::test]
    async fn a_condition_past_the_descriptors_is_internal_not_a_crash() {
        let limiter = Limiter::memory(ReservationLimits::default());
        let yaml = "- {namespace: ns, max_value: 1, seconds: 1, conditions: [\"descriptors[3].k == 'v'\"], variables: []}";
        limiter
            .configure_with(parse_limits(yaml).unwrap())
            .await
            .unwrap();
        let s = Rls::new(
            Arc::new(limiter),
            RateLimitHeaders::None,
            Duration::from_secs(1),
        );
        // limitador 0.14.0 unwraps the condition's evaluation error (an index out of range)
        // and panics; the real server's handler dies with it. Here it is INTERNAL, and the
        // service goes on answering.
        let status = s.should_rate_limit(req("ns", "req", 1)).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal);
        let r = s.should_rate_limit(req("other", "req", 1)).await.unwrap();
        assert_eq!(r.into_inner().overall_code, Code::Ok as i32);
    }
}
