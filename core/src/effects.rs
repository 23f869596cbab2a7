//! The boundary between the core's `Worker` and a host: what the host lends each call, and the
//! effects it applies for a stream (in order, then continue or pause). How a host applies them
//! is `protocol`.

use crate::fleet::grpc::ServiceCall;
use crate::metrics::Metrics;
use crate::reply::LocalReply;
use crate::store::SharedStore;

/// How often a host wakes a worker that holds or waits, at the finest: proxy-wasm's tick
/// period, the native timer's retry of a wake-up that did not run, and the pace at which a
/// request the fleet refused with no wait asks again (`fleet::ask::refusal_wait_ms`).
pub const TICK_MS: u64 = 20;

/// What the host lends a call: its shared store, its stats sink, its clock (read only if the
/// answer needs the time, once per call) and access to the streams' buffers.
pub struct Lent<'a> {
    pub store: &'a dyn SharedStore,
    pub metrics: &'a mut dyn Metrics,
    pub clock: &'a dyn Fn() -> u64,
    pub io: &'a mut dyn StreamIo,
}

/// Reading what Envoy buffers for a stream (the current one, or in a tick any paused one).
pub trait StreamIo {
    /// Up to `max` bytes of the request body buffered for stream `id` (empty if none).
    fn request_body(&mut self, id: u32, max: usize) -> Vec<u8>;
    /// Up to `max` bytes of the response body buffered for stream `id` (empty if none).
    fn response_body(&mut self, id: u32, max: usize) -> Vec<u8>;
    /// Whether stream `id`'s response came from the upstream rather than from Envoy itself
    /// (a reset, a timeout, no healthy host): `from_upstream` of its `response.code_details`.
    fn answered_by_upstream(&mut self, id: u32) -> bool;
}

/// Whether a response whose `response.code_details` are `details` came from the upstream:
/// Envoy says `via_upstream` for the upstream's own responses. Unknown details (a host that
/// cannot read them) count as the upstream's: the provider's word is never thrown away for
/// want of a property.
pub fn from_upstream(details: Option<&[u8]>) -> bool {
    details.map_or(true, |d| d == b"via_upstream")
}

/// Which way a body flows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Request,
    Response,
}

/// Buffers for callers whose streams have no bodies and whose responses are all the
/// upstream's (benchmarks, and tests of the request path).
pub struct NoBodies;

impl StreamIo for NoBodies {
    fn request_body(&mut self, _: u32, _: usize) -> Vec<u8> {
        Vec::new()
    }
    fn response_body(&mut self, _: u32, _: usize) -> Vec<u8> {
        Vec::new()
    }
    fn answered_by_upstream(&mut self, _: u32) -> bool {
        true
    }
}

/// What the host does for a stream, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Remove the client-sent steering header (only the policy picks a pool). If that fails,
    /// tell `Worker::failed` (`Failure::Strip`).
    StripSteeringHeader,
    /// Name the pool the request was steered to in its headers, so the router selects that
    /// pool's route (before it goes on: a paused request's headers are released on resume).
    Steer(String),
    /// Set these response headers.
    SetResponseHeaders(Vec<(&'static str, String)>),
    /// Record these access-log fields (filter-state key, value).
    AccessLog(Vec<(&'static str, String)>),
    /// Drop the request body buffered so far (`n` bytes): the request will never go upstream,
    /// and Envoy's buffer limit (which would answer 413) must not be reached by a large prompt.
    DropRequestBody(usize),
    /// Answer locally. If that fails, tell `Worker::failed` (`Failure::Reply`).
    SendReply(LocalReply),
    /// Let the paused request go on (after a tick). If that fails, tell `Worker::failed`
    /// (`Failure::Resume`).
    ResumeRequest,
    /// Let the paused response go on (after a tick).
    ResumeResponse,
    /// Call the fleet's rate-limit service on `fleet.cluster` for this stream: report the
    /// host's token with `Calls::sent` and what became of it with
    /// `Worker::on_call_done`. If it cannot be sent, tell `Worker::failed` (`Failure::Call`).
    CallService(ServiceCall),
}

impl Effect {
    /// The failure `Worker::failed` must hear of when the host cannot apply this effect (the
    /// others are only logged).
    pub fn failure(&self) -> Option<Failure> {
        match self {
            Effect::StripSteeringHeader => Some(Failure::Strip),
            Effect::SendReply(_) => Some(Failure::Reply),
            Effect::ResumeRequest => Some(Failure::Resume),
            Effect::CallService(call) => Some(Failure::Call(call.seq)),
            _ => None,
        }
    }

    /// What the effect does, for a host's log line when it fails.
    pub fn what(&self) -> &'static str {
        match self {
            Effect::StripSteeringHeader => {
                "removing a client-sent steering header (the request is refused)"
            }
            Effect::Steer(_) => "naming the pool a request was steered to",
            Effect::SetResponseHeaders(_) => "setting response headers",
            Effect::AccessLog(_) => "recording access-log fields",
            Effect::DropRequestBody(_) => "dropping a request body",
            Effect::SendReply(_) => "sending a local answer (the request goes on)",
            Effect::ResumeRequest => "resuming a request",
            Effect::ResumeResponse => "resuming a response",
            Effect::CallService(_) => "calling the fleet's rate-limit service",
        }
    }
}

/// Whether the callback's direction goes on now or stays paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

/// What a callback (or a tick, for one stream) asks of the host: the effects, in order, then the
/// action. A tick's reactions resume streams by effects and always say `Pause`; only
/// `Worker::failed` may answer a tick's failed reply with `Continue`: resume the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reaction {
    pub effects: Vec<Effect>,
    pub action: Action,
}

impl Reaction {
    pub(crate) fn new(effects: Vec<Effect>, action: Action) -> Reaction {
        Reaction { effects, action }
    }

    pub fn go_on() -> Reaction {
        Reaction::new(Vec::new(), Action::Continue)
    }

    /// Nothing to do: the stream stays paused (or, from a tick, as it is).
    pub(crate) fn pause() -> Reaction {
        Reaction::new(Vec::new(), Action::Pause)
    }
}

/// An effect the host could not apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The client-sent steering header could not be removed.
    Strip,
    /// The local answer could not be sent.
    Reply,
    /// The paused request could not be resumed (the stream is gone).
    Resume,
    /// The call to the fleet's service with this `seq` could not be sent.
    Call(u32),
}

/// Set `headers` on the response and record what the access log reads of them.
pub fn set_headers(effects: &mut Vec<Effect>, headers: Vec<(&'static str, String)>) {
    effects.push(Effect::AccessLog(crate::reply::access_log(&headers)));
    effects.push(Effect::SetResponseHeaders(headers));
}
