//! The boundary between the core's `Worker` and a host: what the host lends each call, and the
//! effects it applies for a stream (in order, then continue or pause).

use crate::fleet::ServiceCall;
use crate::metrics::Metrics;
use crate::reply::LocalReply;
use crate::store::SharedStore;

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
    /// (a reset, a timeout, no healthy host). When unknown: true.
    fn answered_by_upstream(&mut self, id: u32) -> bool;
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
    /// Call the fleet's rate-limit service on `fleet.cluster` for this stream, and report what
    /// became of it with `Worker::on_service_answer`. If it cannot be sent, tell
    /// `Worker::failed` (`Failure::Call`).
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

    pub(crate) fn go_on() -> Reaction {
        Reaction::new(Vec::new(), Action::Continue)
    }

    /// Nothing to do, and the stream stays as it is.
    pub(crate) fn none() -> Reaction {
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
