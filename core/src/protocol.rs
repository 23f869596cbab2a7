//! The protocol between a worker and its host, written once for every host: how a `Reaction`
//! is applied (effects in order; the first that fails goes to `Worker::failed`, whose answer
//! replaces the rest), what a reaction from outside a stream's callbacks means (the stream may
//! be gone; `Continue` means resume the request), how calls to the fleet's service are sent
//! and their answers routed, and the load-time check of the service's cluster.
//!
//! A host implements `Host` over its ABI (proxy-wasm's hostcalls, the dynamic module's
//! callbacks) and calls these functions from its callbacks; it decides nothing. The worker is
//! never borrowed while an effect runs: an effect may re-enter the host (a local answer runs
//! the response path at once), and the re-entered callback must find the worker free.

use crate::effects::{Action, Direction, Effect, Failure, Lent, Reaction};
use crate::fleet::grpc::{self, ServiceCall, ServiceReply};
use crate::reply::LocalReply;
use crate::request::STEERING_HEADER;
use crate::worker::Worker;

/// What a host can do to one stream: the primitives every effect is made of. Each says
/// whether it was done.
pub trait StreamOps {
    /// Set (`Some`) or remove a request header; the route is chosen again by the new headers.
    fn request_header(&self, name: &str, value: Option<&str>) -> bool;
    fn response_header(&self, name: &str, value: &str) -> bool;
    /// A filter-state field the access log reads (`%FILTER_STATE(wasm.<key>:PLAIN)%`).
    fn filter_state(&self, key: &str, value: &str) -> bool;
    /// Drop the first `n` bytes of the request body Envoy buffers.
    fn drop_request_body(&self, n: usize) -> bool;
    fn send_reply(&self, reply: &LocalReply) -> bool;
    fn resume(&self, direction: Direction) -> bool;
}

/// One effect as a stream's primitives (`CallService` is the host's `send`).
pub fn apply_effect(ops: &impl StreamOps, effect: Effect) -> bool {
    // Every write is made, the failure of one reported.
    let every = |done: &mut dyn Iterator<Item = bool>| done.fold(true, |all, ok| ok & all);
    match effect {
        Effect::StripSteeringHeader => ops.request_header(STEERING_HEADER, None),
        Effect::Steer(pool) => ops.request_header(STEERING_HEADER, Some(&pool)),
        Effect::SetResponseHeaders(hs) => {
            every(&mut hs.iter().map(|(n, v)| ops.response_header(n, v)))
        }
        Effect::AccessLog(fields) => every(&mut fields.iter().map(|(k, v)| ops.filter_state(k, v))),
        Effect::DropRequestBody(n) => ops.drop_request_body(n),
        Effect::SendReply(r) => ops.send_reply(&r),
        Effect::ResumeRequest => ops.resume(Direction::Request),
        Effect::ResumeResponse => ops.resume(Direction::Response),
        Effect::CallService(_) => false,
    }
}

/// What a host provides: the mechanism, never the decision.
pub trait Host {
    /// A stream effects apply to.
    type Stream: StreamOps;

    /// Run `f` on the worker, with what the host lends a call; `current` is the stream whose
    /// callback runs (None outside any). None when the worker is busy (a callback re-entered)
    /// or unusable: the caller then goes on, ungoverned.
    fn with_worker<T>(
        &self,
        current: Option<u32>,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> Option<T>;

    /// Stream `id` in its own callback.
    fn current(&self, id: u32) -> Self::Stream;

    /// Stream `id` outside its own callbacks (a tick, an answer of the service), addressed
    /// again; None when it is gone.
    fn stream(&self, id: u32) -> Option<Self::Stream>;

    /// Send `call` to the fleet's service for `stream` (None: owed by no stream, sent so that
    /// it outlives every stream): the host's token for its answer, or None when it could not
    /// be sent.
    fn send(&self, stream: Option<&Self::Stream>, call: &ServiceCall) -> Option<u64>;

    /// Stream `id`'s callback left it paused: a host that addresses paused streams from
    /// outside their callbacks keeps it.
    fn paused(&self, _id: u32) {}
}

/// A callback of stream `id`: the worker's reaction, applied; the action for Envoy.
pub fn callback<H: Host>(
    host: &H,
    id: u32,
    f: impl FnOnce(&mut Worker, u32, &mut Lent) -> Reaction,
) -> Action {
    let Some(reaction) = host.with_worker(Some(id), |w, lent| f(w, id, lent)) else {
        return Action::Continue;
    };
    let action = apply(host, id, &host.current(id), reaction);
    if action == Action::Pause {
        host.paused(id);
    }
    action
}

/// Apply a reaction's effects to stream `id` in order. The first that fails is reported to the
/// worker, whose answer replaces the rest and is applied without further reports (a worker
/// that cannot answer: go on, ungoverned).
pub fn apply<H: Host>(host: &H, id: u32, stream: &H::Stream, reaction: Reaction) -> Action {
    let mut effects = reaction.effects.into_iter();
    let Some(failure) = effects.find_map(|e| effect(host, id, stream, e)) else {
        return reaction.action;
    };
    let instead = host.with_worker(Some(id), |w, lent| w.failed(id, failure, lent));
    let instead = instead.unwrap_or_else(Reaction::go_on);
    for e in instead.effects {
        effect(host, id, stream, e);
    }
    instead.action
}

/// A reaction for stream `id` from outside its callbacks (a tick, an answer of the service).
/// A stream the host can no longer address is gone: it ends now. `Continue` (only a failed
/// answer says so from outside a callback) lets the request go on.
pub fn apply_later<H: Host>(host: &H, id: u32, reaction: Reaction) {
    let Some(stream) = host.stream(id) else {
        host.with_worker(None, |w, lent| w.on_end(id, lent));
        return;
    };
    if apply(host, id, &stream, reaction) == Action::Continue {
        effect(host, id, &stream, Effect::ResumeRequest);
    }
}

/// The host's timer: the worker's tick, each due stream's reaction applied. (The calls owed by
/// no stream are the host's to send where they outlive every stream: `send_owed`.)
pub fn tick<H: Host>(host: &H) {
    let due = host.with_worker(None, |w, lent| w.tick(lent));
    for (id, reaction) in due.unwrap_or_default() {
        apply_later(host, id, reaction);
    }
}

/// Stream `id` is over (complete, reset, or its context going away).
pub fn end<H: Host>(host: &H, id: u32) {
    host.with_worker(Some(id), |w, lent| w.on_end(id, lent));
}

/// Envoy delivered what became of call `token` of `stream` (None: a call owed by no stream).
pub fn call_done<H: Host>(host: &H, stream: Option<u32>, token: u64, reply: ServiceReply) {
    let reaction = host.with_worker(stream, |w, lent| w.on_call_done(stream, token, reply, lent));
    if let Some((id, r)) = reaction.flatten() {
        apply_later(host, id, r);
    }
}

/// Send the calls owed by no stream (commits at a stream's end, releases); one that cannot be
/// sent is a failed call.
pub fn send_owed<H: Host>(host: &H) {
    let owed = host.with_worker(None, |w, _| w.calls().take_owed());
    for call in owed.unwrap_or_default() {
        match host.send(None, &call) {
            Some(token) => host.with_worker(None, |w, _| w.calls().sent(None, token, call.seq)),
            None => {
                log_not_sent();
                host.with_worker(None, |w, lent| w.call_not_sent(call.seq, lent))
            }
        };
    }
}

/// One effect on stream `id`; the failure the worker must hear of, if it failed.
fn effect<H: Host>(host: &H, id: u32, stream: &H::Stream, effect: Effect) -> Option<Failure> {
    let failure = effect.failure();
    if let Effect::CallService(call) = &effect {
        let Some(token) = host.send(Some(stream), call) else {
            log_not_sent();
            return failure;
        };
        host.with_worker(Some(id), |w, _| w.calls().sent(Some(id), token, call.seq));
        return None;
    }
    let what = effect.what();
    if apply_effect(stream, effect) {
        return None;
    }
    log::warn!("llm_governor: {what} failed");
    failure
}

fn log_not_sent() {
    log::warn!(
        "llm_governor: calling the fleet's rate-limit service failed (its fleet.on_error decides); \
         check that fleet.cluster is an HTTP/2 cluster Envoy can reach"
    );
}

/// A configuration as a host loads it (JSON, its ids keyed with `key`): the governor, or the
/// message to log ("invalid configuration: <field>: <reason>"). With fleet limits, Envoy must
/// have `fleet.cluster`: `cluster_exists` asks it (a gRPC health check on the cluster,
/// `grpc::HEALTH_*`, whose answer is never read: Envoy refuses a call to a cluster it lacks
/// at once), so a wrong name is refused at load rather than failing every request.
pub fn load(
    json: &[u8],
    key: crate::keys::HashKey,
    cluster_exists: impl FnOnce(&str) -> bool,
) -> Result<crate::policy::Governor, String> {
    let gov = crate::policy::Governor::load(json, key)?;
    match &gov.cfg.fleet {
        Some(f) if !cluster_exists(&f.cluster) => Err(grpc::no_such_cluster(&f.cluster)),
        _ => Ok(gov),
    }
}
