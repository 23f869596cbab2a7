//! The fleet's rate-limit service as the native module reaches it: HTTP callouts carrying gRPC
//! (`fleet::grpc`), a stream's own calls on its filter, and the calls owed by no stream
//! (commits and releases after a stream is gone) from the main thread, through the
//! configuration's scheduler, with the main thread as the core's `Host` of each worker.

use super::abi::{Answer, Callout, ConfigScheduler, MainThread};
use super::adapters;
use super::Module;
use llm_governor_core::effects::{Direction, Lent, NoBodies};
use llm_governor_core::fleet::grpc::{self, ServiceCall, ServiceReply};
use llm_governor_core::protocol::{self, Host, StreamOps};
use llm_governor_core::reply::LocalReply;
use llm_governor_core::worker::Worker;
use std::collections::HashMap;
use std::sync::Mutex;

/// The way to the fleet's rate-limit service.
pub struct Fleet {
    pub cluster: String,
    /// Runs `send_owed` on the main thread.
    pub scheduler: ConfigScheduler,
    /// The worker slot of each call the main thread sent, by callout id.
    pub out: Mutex<HashMap<u64, usize>>,
}

/// The main thread as the core's `Host` of worker `slot`: it sends that worker's owed calls and
/// hears their answers. It addresses no stream: `idle`, it reaches the worker only while none
/// of its streams is paused (a tick then has no stream to address).
struct Main<'a> {
    module: &'a Module,
    slot: usize,
    main: &'a MainThread,
    idle: bool,
}

impl Host for Main<'_> {
    type Stream = NoStream;

    fn with_worker<T>(
        &self,
        _: Option<u32>,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> Option<T> {
        let mut state = self.module.slots.get(self.slot)?.state.lock().ok()?;
        if self.idle && !state.paused.is_empty() {
            return None;
        }
        let mut lent = Lent {
            store: adapters::store(),
            metrics: &mut self.module.stats.on_main(self.main),
            clock: &adapters::now_ms,
            io: &mut NoBodies,
        };
        Some(f(&mut state.worker, &mut lent))
    }

    /// The main thread addresses no stream (Envoy's calls for streams are their filters').
    fn current(&self, _: u32) -> NoStream {
        NoStream
    }

    fn stream(&self, _: u32) -> Option<NoStream> {
        None
    }

    fn send(&self, stream: Option<&NoStream>, call: &ServiceCall) -> Option<u64> {
        let fleet = self.module.fleet.as_ref().filter(|_| stream.is_none())?;
        let callout = fleet.send(call, |c| self.main.callout(c))?;
        if let Ok(mut out) = fleet.out.lock() {
            out.insert(callout, self.slot);
        }
        Some(callout)
    }
}

impl Fleet {
    /// `call` as gRPC in an HTTP callout made by `via` (a stream's filter, or the
    /// configuration for a call no stream owns); its callout id, or None (logged) when Envoy
    /// refuses to start it.
    pub fn send(
        &self,
        call: &ServiceCall,
        via: impl FnOnce(&Callout) -> Result<u64, u32>,
    ) -> Option<u64> {
        let headers = grpc::request_headers(&grpc::path(call.method), &self.cluster);
        let body = grpc::frame(&call.message);
        let sent = via(&Callout {
            cluster: &self.cluster,
            headers: &headers,
            body: &body,
            timeout_ms: call.timeout_ms,
        });
        sent.inspect_err(|why| {
            let why = super::abi::callout_refusal(*why);
            log::warn!(
                "llm_governor: Envoy refused a callout to {} ({why})",
                self.cluster
            );
        })
        .ok()
    }
}

/// On the main thread, the configuration's scheduler's event: the timer's `IDLE_TICK` ticks
/// each worker with no paused stream (re-armed after); then every worker's owed calls go.
pub fn scheduled(module: &Module, main: &MainThread, event: u64) {
    if event == super::timer::IDLE_TICK {
        for slot in 0..module.slots.len() {
            let host = Main {
                module,
                slot,
                main,
                idle: true,
            };
            protocol::tick(&host);
            if let Some(next) = host.with_worker(None, |w, _| w.next_due_ms()) {
                module.timer.arm(slot, next);
            }
        }
    }
    send_owed(module, main);
}

/// On the main thread: send every worker's owed calls.
pub fn send_owed(module: &Module, main: &MainThread) {
    for slot in 0..module.slots.len() {
        protocol::send_owed(&Main {
            module,
            slot,
            main,
            idle: false,
        });
    }
}

/// On the main thread: an owed call came back.
pub fn owed_done(module: &Module, main: &MainThread, callout: u64, answer: &Answer) {
    let out = module.fleet.as_ref().and_then(|f| f.out.lock().ok());
    let Some(slot) = out.and_then(|mut out| out.remove(&callout)) else {
        return;
    };
    let host = Main {
        module,
        slot,
        main,
        idle: false,
    };
    protocol::call_done(&host, None, callout, reply(answer));
    // What the answer owes goes at once (a slot's renewal, a turn taken again), and the
    // worker's next deadline (a slot renewed is taken again later) is armed.
    protocol::send_owed(&host);
    if let Some(next) = host.with_worker(None, |w, _| w.next_due_ms()) {
        module.timer.arm(slot, next);
    }
}

/// What the service's answer means to the core.
pub fn reply(answer: &Answer) -> ServiceReply<'_> {
    if !answer.answered {
        return ServiceReply::Failed(grpc::UNAVAILABLE); // reset or timed out
    }
    grpc::reply(
        answer.status.as_deref(),
        answer.grpc_status.as_deref(),
        &answer.body,
    )
}

/// No stream: the main thread's.
struct NoStream;

impl StreamOps for NoStream {
    fn request_header(&self, _: &str, _: Option<&str>) -> bool {
        false
    }
    fn response_header(&self, _: &str, _: &str) -> bool {
        false
    }
    fn filter_state(&self, _: &str, _: &str) -> bool {
        false
    }
    fn drop_request_body(&self, _: usize) -> bool {
        false
    }
    fn send_reply(&self, _: &LocalReply) -> bool {
        false
    }
    fn resume(&self, _: Direction) -> bool {
        false
    }
}
