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

use crate::effects::{Action, Effect, Failure, Lent, Reaction};
use crate::fleet::grpc::{self, ServiceCall, ServiceReply};
use crate::worker::Worker;

/// What a host provides: the mechanism, never the decision.
pub trait Host {
    /// Run `f` on the worker, with what the host lends a call; `current` is the stream whose
    /// callback runs (None outside any). None when the worker is busy (a callback re-entered)
    /// or unusable: the caller then goes on, ungoverned.
    fn with_worker<T>(
        &self,
        current: Option<u32>,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> Option<T>;

    /// Make stream `id` the one effects apply to, outside its own callbacks; false when it is
    /// gone.
    fn focus(&self, id: u32) -> bool;

    /// Apply `effect` (never `CallService`) to stream `id`; false when the host could not.
    fn apply(&self, id: u32, effect: Effect) -> bool;

    /// Send `call` to the fleet's service for `stream` (None: owed by no stream, sent so that
    /// it outlives every stream): the host's token for its answer, or None when it could not
    /// be sent.
    fn send(&self, stream: Option<u32>, call: &ServiceCall) -> Option<u64>;

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
    let action = apply(host, id, reaction);
    if action == Action::Pause {
        host.paused(id);
    }
    action
}

/// Apply a reaction's effects to stream `id` in order. The first that fails is reported to the
/// worker, whose answer replaces the rest and is applied without further reports (a worker
/// that cannot answer: go on, ungoverned).
pub fn apply<H: Host>(host: &H, id: u32, reaction: Reaction) -> Action {
    let mut effects = reaction.effects.into_iter();
    let Some(failure) = effects.find_map(|e| effect(host, id, e)) else {
        return reaction.action;
    };
    let instead = host.with_worker(Some(id), |w, lent| w.failed(id, failure, lent));
    let instead = instead.unwrap_or_else(Reaction::go_on);
    for e in instead.effects {
        effect(host, id, e);
    }
    instead.action
}

/// A reaction for stream `id` from outside its callbacks (a tick, an answer of the service).
/// A stream the host can no longer address is gone: it ends now. `Continue` (only a failed
/// answer says so from outside a callback) lets the request go on.
pub fn apply_later<H: Host>(host: &H, id: u32, reaction: Reaction) {
    if !host.focus(id) {
        host.with_worker(None, |w, lent| w.on_end(id, lent));
        return;
    }
    if apply(host, id, reaction) == Action::Continue {
        effect(host, id, Effect::ResumeRequest);
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
                host.with_worker(None, |w, lent| w.calls().not_sent(call.seq, lent.metrics))
            }
        };
    }
}

/// One effect on stream `id`; the failure the worker must hear of, if it failed.
fn effect<H: Host>(host: &H, id: u32, effect: Effect) -> Option<Failure> {
    let failure = effect.failure();
    if let Effect::CallService(call) = &effect {
        let Some(token) = host.send(Some(id), call) else {
            log_not_sent();
            return failure;
        };
        host.with_worker(Some(id), |w, _| w.calls().sent(Some(id), token, call.seq));
        return None;
    }
    let what = effect.what();
    if host.apply(id, effect) {
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

/// At load, with fleet limits: whether Envoy has `fleet.cluster`. `exists` asks Envoy (a gRPC
/// health check on the cluster, `grpc::HEALTH_*`, whose answer is never read: Envoy refuses
/// a call to a cluster it lacks at once). The message to refuse the configuration with when
/// it does not, so a wrong name is refused at load rather than failing every request.
pub fn check_cluster(
    cfg: &crate::config::Config,
    exists: impl FnOnce(&str) -> bool,
) -> Result<(), String> {
    match &cfg.fleet {
        Some(f) if !exists(&f.cluster) => Err(grpc::no_such_cluster(&f.cluster)),
        _ => Ok(()),
    }
}
