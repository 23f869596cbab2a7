//! A call to the fleet's rate-limit service as the core hands it to a host, what became of it
//! as the host reports it, and, for a host whose only way to the service is an HTTP callout
//! (the native module), the unary gRPC call as a plain HTTP/2 request and what its answer
//! (headers and body; Envoy's callout hands over no trailers) means.

use std::sync::atomic::{AtomicBool, Ordering};

/// A method of the rate-limit services.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
    ShouldRateLimit,
    /// `kuadrant.service.ratelimit.v1.RateLimitService/Reserve`.
    Reserve,
    /// `kuadrant.service.ratelimit.v1.RateLimitService/Commit`.
    Commit,
    /// `kuadrant.service.ratelimit.v1.RateLimitService/CheckRateLimit`: a check of one hit
    /// that counts nothing.
    CheckRateLimit,
}

impl Method {
    pub fn service(self) -> &'static str {
        match self {
            Method::ShouldRateLimit => "envoy.service.ratelimit.v3.RateLimitService",
            Method::Reserve | Method::Commit | Method::CheckRateLimit => {
                "kuadrant.service.ratelimit.v1.RateLimitService"
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Method::ShouldRateLimit => "ShouldRateLimit",
            Method::Reserve => "Reserve",
            Method::Commit => "Commit",
            Method::CheckRateLimit => "CheckRateLimit",
        }
    }
}

/// A call to the fleet's service, for the host to dispatch on `fleet.cluster`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCall {
    pub seq: u32,
    pub method: Method,
    pub message: Vec<u8>,
    pub timeout_ms: u64,
}

/// What became of a call, as the host reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceReply<'a> {
    /// The service answered (gRPC status OK) with this message.
    Message(&'a [u8]),
    /// No answer: the gRPC status (4 = deadline exceeded, 14 = unavailable, …), or
    /// `NOT_SENT` when the call could not be sent at all.
    Failed(u32),
}

/// The status of a call the host could not send (not a gRPC code: gRPC's 0 is OK, which a
/// failure never is).
pub const NOT_SENT: u32 = 0;
/// gRPC status codes a host reports when the call fails below gRPC.
pub const UNKNOWN: u32 = 2;
/// What a server answers a method it does not have (limitador-server before its reservations, or
/// a storage without them, to a `Reserve`).
pub const UNIMPLEMENTED: u32 = 12;
pub const INTERNAL: u32 = 13;
pub const UNAVAILABLE: u32 = 14;

/// The gRPC health check a host asks of `fleet.cluster` at load, to learn that Envoy has it.
pub const HEALTH_SERVICE: &str = "grpc.health.v1.Health";
pub const HEALTH_METHOD: &str = "Check";
/// How long the load-time health check may take (its answer is never read).
pub const HEALTH_CHECK_TIMEOUT_MS: u64 = 1000;

/// The load-time refusal of a `fleet.cluster` Envoy lacks (both hosts ask Envoy at load).
pub fn no_such_cluster(cluster: &str) -> String {
    format!("invalid configuration: fleet.cluster: Envoy has no cluster {cluster:?}")
}

/// What a host reads of a call Envoy delivered: the answer's message when it came with status
/// OK (`status` 0) and could be read; a failure with the status otherwise (an answer that came
/// but could not be read is UNKNOWN).
pub fn delivered(status: u32, message: Option<&[u8]>) -> ServiceReply<'_> {
    match (status, message) {
        (0, Some(m)) => ServiceReply::Message(m),
        (0, None) => ServiceReply::Failed(UNKNOWN),
        (s, _) => ServiceReply::Failed(s),
    }
}

/// The path of `method`.
pub fn path(method: Method) -> String {
    format!("/{}/{}", method.service(), method.name())
}

/// The path of the load-time health check.
pub fn health_path() -> String {
    format!("/{HEALTH_SERVICE}/{HEALTH_METHOD}")
}

/// The request headers of a call on `path` sent to `authority` (the cluster's name).
pub fn request_headers(path: &str, authority: &str) -> [(&'static str, String); 5] {
    [
        (":method", "POST".to_string()),
        (":path", path.to_string()),
        ("host", authority.to_string()),
        ("content-type", "application/grpc".to_string()),
        ("te", "trailers".to_string()),
    ]
}

/// `message` as one uncompressed gRPC frame.
pub fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len().min(u32::MAX as usize) as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// What an HTTP answer says: `:status`, `grpc-status` (present in the headers of a
/// trailers-only answer, which is how gRPC servers send errors) and the body. A status in the
/// trailers, which the callout drops, reads as OK when a whole message came, and as UNKNOWN
/// when none did.
pub fn reply<'a>(
    status: Option<&[u8]>,
    grpc_status: Option<&[u8]>,
    body: &'a [u8],
) -> ServiceReply<'a> {
    if let Some(code) = grpc_status {
        let code = crate::time::whole_number(code.trim_ascii());
        match code.and_then(|c| u32::try_from(c).ok()) {
            Some(0) => {}
            Some(code) => return ServiceReply::Failed(code),
            None => return ServiceReply::Failed(UNKNOWN),
        }
    }
    if status != Some(b"200".as_slice()) {
        return ServiceReply::Failed(from_http(status));
    }
    let Some((head, rest)) = body.split_first_chunk::<5>() else {
        return ServiceReply::Failed(if body.is_empty() { UNKNOWN } else { INTERNAL });
    };
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    match (head[0], rest.get(..len)) {
        (0, Some(message)) => ServiceReply::Message(message),
        // A compressed frame (never asked for) or a truncated one.
        _ => ServiceReply::Failed(INTERNAL),
    }
}

/// gRPC's mapping of an HTTP status that is not 200 to a gRPC code.
fn from_http(status: Option<&[u8]>) -> u32 {
    match status {
        Some(b"400") => INTERNAL,
        Some(b"401") => 16,
        Some(b"403") => 7,
        Some(b"404") => UNIMPLEMENTED,
        Some(b"429" | b"502" | b"503" | b"504") => UNAVAILABLE,
        _ => UNKNOWN,
    }
}

/// Said once per worker: a service that answers `Reserve` with UNIMPLEMENTED has no
/// reservations (limitador-server released before them, or a storage without them), and every
/// token budget, fleet slot and turn falls to `fleet.on_error`.
pub fn warn_if_no_reservations(code: u32) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if code != UNIMPLEMENTED {
        return;
    }
    warn_once(&WARNED, || {
        "llm_governor: the rate-limit service answered Reserve with UNIMPLEMENTED, so token \
         budgets, fleet max_in_flight and fleet.cooldowns fall to fleet.on_error: run \
         limitador-server with Reserve/Commit (its main branch since 2026-09; storage redis, or \
         memory for a single server), or set fleet.reservations: false"
            .to_string()
    });
}

/// Said once per worker: a service that answers `CheckRateLimit` with UNIMPLEMENTED (a server
/// without Kuadrant's service) cannot tell an Envoy that another one cools a (pool, account),
/// so each Envoy learns a cooldown from its own first 429.
pub fn warn_if_no_check(code: u32) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if code != UNIMPLEMENTED {
        return;
    }
    warn_once(&WARNED, || {
        "llm_governor: the rate-limit service answered CheckRateLimit with UNIMPLEMENTED, so \
         each Envoy learns a cooldown from its own first 429: run limitador-server (Kuadrant's \
         kuadrant.service.ratelimit.v1 service)"
            .to_string()
    });
}

/// Logs `message` at warn level the first time `warned` is set (a worker's "said once").
pub fn warn_once(warned: &AtomicBool, message: impl FnOnce() -> String) {
    if !warned.swap(true, Ordering::Relaxed) {
        log::warn!("{}", message());
    }
}
