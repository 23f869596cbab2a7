//! Fleet limits (`limits[].scope: "fleet"`): budgets several Envoys share through a rate-limit
//! service (Envoy's RLS protocol, answered by Limitador on Redis). What admission asks the
//! service, what each answer means, and what a stream owes the service at its end. Sans-IO: the
//! worker sends the calls as effects and hears the answers; a host only moves the bytes.
//!
//! One call per fleet limit, each with the one descriptor an operator's limits file matches
//! (`descriptors[0]['limit']`, `descriptors[0]['key']`), sent together. Token budgets reserve
//! (Limitador's Reserve, settled by Commit at the stream's end) or, on a server without
//! reservations, charge at admission and top up after with positive hits only: nothing is
//! ever sent that a server could read as a refund.

use crate::config::{LimitKey, LimitKind};
use crate::flow::Flow;
use crate::headers::Headers;
use crate::keys;
use crate::policy::Governor;
use crate::retry_after::Random;
use crate::rls::{self, Code, Descriptor};

/// How long the service holds a token reservation for a stream that never commits (Limitador
/// caps it at its `--max-reservation-ttl`, 60 s by default).
pub const RESERVATION_TTL_MS: u64 = 60_000;
/// How long past `fleet.timeout_ms` the worker waits for an answer Envoy never delivered before
/// it applies the fallback itself.
pub const ANSWER_SLACK_MS: u64 = 50;
/// A key value longer than this goes to the service as its keyed id.
const MAX_KEY_VALUE: usize = 256;
/// While the service reports no wait, a held request it refused asks again after this long on
/// average (`refusal_wait_ms`): the wasm host's tick.
pub const REASK_MS: u64 = 20;

/// How many of a request's `asks` (token budgets first) go out first. Reservations go first
/// when other asks follow: a refusal gives a reservation back at no cost (a Commit of 0), where
/// a hit `ShouldRateLimit` counted (or a token charge) is never given back. So the rest are
/// asked only once no reservation was refused: a request the token budget turns away, and
/// every ask again of a held one, costs the request budget nothing. All at once when nothing
/// reserves, or everything does.
pub(crate) fn first_stage(asks: &[Ask]) -> usize {
    match asks.iter().take_while(|a| a.reserve).count() {
        0 => asks.len(),
        n => n,
    }
}

/// The wait of a fleet refusal: the service's reset, or `default_ms` when it reports none.
/// Limitador reports its reset in whole seconds rounded down, so in a window's last second it
/// says 0; a wait under `REASK_MS` is drawn from [that wait or 1, 2 × REASK_MS) instead. A held
/// request then asks about every REASK_MS, not as fast as the service answers (the native host
/// has no tick to round a 1 ms wait up), and requests refused together do not ask again
/// together, where checks that overlap could each pass (README, "Overshoot").
pub(crate) fn refusal_wait_ms(
    reported_ms: Option<u64>,
    default_ms: u64,
    rng: &mut dyn Random,
) -> u64 {
    let ms = reported_ms.unwrap_or(default_ms);
    if ms >= REASK_MS {
        return ms;
    }
    let low = ms.max(1);
    low + (rng.unit().clamp(0.0, 1.0) * (2 * REASK_MS - low) as f64) as u64
}

/// The load-time refusal of a `fleet.cluster` Envoy lacks (both hosts ask Envoy at load).
pub fn no_such_cluster(cluster: &str) -> String {
    format!("invalid configuration: fleet.cluster: Envoy has no cluster {cluster:?}")
}

/// A method of the rate-limit services.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
    ShouldRateLimit,
    /// `kuadrant.service.ratelimit.v1.RateLimitService/Reserve`.
    Reserve,
    /// `kuadrant.service.ratelimit.v1.RateLimitService/Commit`.
    Commit,
}

impl Method {
    pub fn service(self) -> &'static str {
        match self {
            Method::ShouldRateLimit => "envoy.service.ratelimit.v3.RateLimitService",
            Method::Reserve | Method::Commit => "kuadrant.service.ratelimit.v1.RateLimitService",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Method::ShouldRateLimit => "ShouldRateLimit",
            Method::Reserve => "Reserve",
            Method::Commit => "Commit",
        }
    }
}

/// A unary gRPC call as a plain HTTP/2 request, for a host whose only way to the service is an
/// HTTP callout (the native module): the request's headers and framed body, and what the
/// answer (headers and body; Envoy's callout hands over no trailers) means.
pub mod grpc {
    use super::{Method, ServiceReply};

    /// gRPC status codes the host reports when the call fails below gRPC.
    pub const UNKNOWN: u32 = 2;
    pub const INTERNAL: u32 = 13;
    pub const UNAVAILABLE: u32 = 14;

    /// The health check a host may ask of a cluster (to learn that the cluster exists).
    pub const HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";

    /// The path of `method`.
    pub fn path(method: Method) -> String {
        format!("/{}/{}", method.service(), method.name())
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

    /// What an answer says: `:status`, `grpc-status` (present in the headers of a
    /// trailers-only answer, which is how gRPC servers send errors) and the body. A status in
    /// the trailers, which the callout drops, reads as OK when a whole message came, and as
    /// UNKNOWN when none did.
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
            Some(b"404") => 12,
            Some(b"429" | b"502" | b"503" | b"504") => UNAVAILABLE,
            _ => UNKNOWN,
        }
    }
}

/// A call to the fleet's service, for the host to dispatch on `fleet.cluster` and answer with
/// `Worker::on_service_answer(stream, seq, …)`.
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
    /// No answer: the gRPC status (4 = deadline exceeded, 14 = unavailable, …), or 0 when the
    /// call could not be sent at all.
    Failed(u32),
}

/// A token budget the fleet charged at admission, settled when the stream ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetCharge {
    pub limit: usize,
    /// The descriptor's key value (the same one is committed against).
    pub key: String,
    /// Reserved (or charged) at admission.
    pub amount: u64,
    /// The service's reservation id, when it holds one.
    pub reservation: Option<String>,
    /// What the stream used, once known (0: the provider answered an error and counted none).
    pub settled: Option<u64>,
}

/// One call of a request's admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) limit: usize,
    pub(crate) key: String,
    /// Requests: 1. Tokens: the reservation (at least 1: a budget with nothing left refuses).
    pub(crate) amount: u64,
    pub(crate) reserve: bool,
}

/// What one answer of admission said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Said {
    Ok { reservation: Option<String> },
    Over { wait_ms: Option<u64> },
    Failed,
}

impl Governor {
    /// The fleet limits, by index (token budgets first).
    pub fn fleet_limits(&self) -> &[usize] {
        &self.fleet_limits
    }

    /// What admission asks the service for this flow: one call per fleet limit.
    pub(crate) fn fleet_asks(&self, flow: &Flow) -> Vec<Ask> {
        let reservations = self.cfg.fleet.as_ref().is_some_and(|f| f.reservations);
        self.fleet_limits
            .iter()
            .map(|&i| {
                let tokens = self.cfg.limits[i].kind == LimitKind::Tokens;
                Ask {
                    limit: i,
                    key: self.fleet_key(i, flow),
                    amount: if tokens {
                        self.limits().cost(i, flow).max(1)
                    } else {
                        1
                    },
                    reserve: tokens && reservations,
                }
            })
            .collect()
    }

    /// The message of one call of admission.
    pub(crate) fn ask_call(&self, ask: &Ask, seq: u32) -> ServiceCall {
        let d = [self.descriptor(ask.limit, ask.key.clone())];
        if ask.reserve {
            self.call(
                seq,
                Method::Reserve,
                rls::reserve(self.domain(), &d, ask.amount, RESERVATION_TTL_MS),
            )
        } else {
            let hits = u32::try_from(ask.amount).unwrap_or(u32::MAX);
            self.call(
                seq,
                Method::ShouldRateLimit,
                rls::should_rate_limit(self.domain(), &d, hits),
            )
        }
    }

    /// What an answer to `ask` says; a message that cannot be read, or a code that is neither
    /// OK nor OVER_LIMIT, is a failure (the fallback decides).
    pub(crate) fn said(&self, ask: &Ask, reply: ServiceReply) -> Said {
        let ServiceReply::Message(bytes) = reply else {
            return Said::Failed;
        };
        let answer = if ask.reserve {
            rls::decode_reserve(bytes)
        } else {
            rls::decode_response(bytes)
        };
        match answer {
            Ok(a) if a.code == Some(Code::Ok) => Said::Ok {
                reservation: a.reservation.filter(|r| !r.is_empty()),
            },
            Ok(a) if a.code == Some(Code::OverLimit) => Said::Over { wait_ms: a.wait_ms },
            _ => Said::Failed,
        }
    }

    /// The calls a charge owes the service when its stream ends: a Commit of what the stream
    /// used (what was reserved when that is unknown); without reservations, a top-up of what
    /// it used beyond the charge, never a refund.
    pub(crate) fn settle_call(&self, charge: &FleetCharge, seq: u32) -> Option<ServiceCall> {
        let used = charge.settled.unwrap_or(charge.amount);
        let d = [self.descriptor(charge.limit, charge.key.clone())];
        let reservations = self.cfg.fleet.as_ref().is_some_and(|f| f.reservations);
        if reservations {
            let id = charge.reservation.as_deref().unwrap_or("");
            return Some(self.call(
                seq,
                Method::Commit,
                rls::commit(self.domain(), &d, id, used),
            ));
        }
        let more = used.checked_sub(charge.amount).filter(|n| *n > 0)?;
        let hits = u32::try_from(more).unwrap_or(u32::MAX);
        Some(self.call(
            seq,
            Method::ShouldRateLimit,
            rls::should_rate_limit(self.domain(), &d, hits),
        ))
    }

    /// A reservation the request will not use (another limit refused it): released at no cost.
    pub(crate) fn release_call(
        &self,
        limit: usize,
        key: String,
        id: &str,
        seq: u32,
    ) -> ServiceCall {
        let d = [self.descriptor(limit, key)];
        self.call(seq, Method::Commit, rls::commit(self.domain(), &d, id, 0))
    }

    fn call(&self, seq: u32, method: Method, message: Vec<u8>) -> ServiceCall {
        ServiceCall {
            seq,
            method,
            message,
            timeout_ms: self.cfg.fleet.as_ref().map_or(50, |f| f.timeout_ms),
        }
    }

    fn domain(&self) -> &str {
        self.cfg.fleet.as_ref().map_or("", |f| f.domain.as_str())
    }

    fn descriptor(&self, limit: usize, key: String) -> Descriptor {
        Descriptor {
            limit: self.cfg.limits[limit].name.clone(),
            key,
        }
    }

    /// The descriptor's `key` for limit `limit`: the header's value, the model, the pool's name,
    /// the pool's account label; a credential (an account, or a header that is one of
    /// `account_headers`) only ever as its keyed id.
    pub(crate) fn fleet_key(&self, limit: usize, flow: &Flow) -> String {
        let raw = || {
            let keys = flow.fleet.as_ref()?;
            keys.keys
                .iter()
                .find(|(i, _)| *i == limit)
                .map(|(_, v)| v.clone())
        };
        match &self.cfg.limits[limit].key {
            LimitKey::Pool => self.cfg.pools[flow.pool].name.clone(),
            LimitKey::Account => match &self.cfg.pools[flow.pool].account {
                Some(label) => label.clone(),
                None => keys::id_hex(flow.account),
            },
            LimitKey::Header(_) | LimitKey::Model { .. } => {
                raw().unwrap_or_else(|| keys::id_hex(flow.limit_keys[limit]))
            }
        }
    }

    /// The raw key values of the fleet limits keyed by a header that is not a credential, or
    /// by a model named in the path, read from the request headers once.
    pub(crate) fn fleet_keys_of(&self, path: &[u8], headers: &Headers) -> Vec<(usize, String)> {
        let model = || keys::model_in_path(path).unwrap_or(b"-");
        self.fleet_limits
            .iter()
            .filter_map(|&i| {
                let value = match &self.cfg.limits[i].key {
                    LimitKey::Header(h) => self.plain_header(h, headers)?.to_vec(),
                    LimitKey::Model { header: None } => model().to_vec(),
                    LimitKey::Model { header: Some(h) } => {
                        let mut v = self.plain_header(h, headers)?.to_vec();
                        v.push(b'+');
                        v.extend_from_slice(model());
                        v
                    }
                    LimitKey::Pool | LimitKey::Account => return None,
                };
                key_value(&value).map(|v| (i, v))
            })
            .collect()
    }

    /// The model the body named, for fleet limits keyed by model whose path named none.
    pub(crate) fn fleet_model_found(&self, flow: &mut Flow, model: &[u8]) {
        let keys = &mut flow.fleet_mut().keys;
        for &i in &self.fleet_limits {
            let LimitKey::Model { header } = &self.cfg.limits[i].key else {
                continue;
            };
            let Some(at) = keys.iter().position(|(l, _)| *l == i) else {
                continue;
            };
            let value = match header {
                None => key_value(model),
                Some(_) => {
                    let prefix = keys[at].1.strip_suffix("+-").map(str::to_string);
                    prefix.and_then(|p| key_value(&[p.as_bytes(), b"+", model].concat()))
                }
            };
            match value {
                Some(v) => keys[at].1 = v,
                None => {
                    keys.remove(at);
                }
            }
        }
    }

    /// A header's value when it is not a credential (`-` when it is missing, as local limits
    /// count it); None for a credential header, whose value only ever goes out as its id.
    fn plain_header<'h>(&self, name: &str, headers: &'h Headers) -> Option<&'h [u8]> {
        if self.cfg.account_headers.iter().any(|a| a == name) {
            return None;
        }
        Some(headers.get(name).unwrap_or(b"-"))
    }
}

/// A descriptor value: printable UTF-8 of at most `MAX_KEY_VALUE` bytes, else None (the keyed
/// id is sent instead).
fn key_value(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?;
    (s.len() <= MAX_KEY_VALUE && !s.chars().any(char::is_control)).then(|| s.to_string())
}
