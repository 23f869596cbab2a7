//! One stream's state in its worker, from its first callback to its end: what it waits for,
//! until when, and what it carries to its next callback; and the worker's table of them,
//! which keeps every wait's deadline in step with its state.
//!
//! ```text
//!  request headers ──► ReadingBody ──┐ (body read, or its wait over)
//!        │                           ▼
//!        └────────────────────► admission ──► Held ──(tick: gates open)──┐
//!                                  │  │                                  │
//!                                  │  └──► ReplyPending ──► answered      │
//!                                  ▼                                     ▼
//!                        AwaitingFleet ──(verdict)──► Upstream ◄─────────┘
//!                                                       │  ▲
//!                          response headers: error ──► AwaitingErrorBody (body or its wait)
//! ```
//! A stream that is in no state (not in the table) is done: answered locally, ended, or
//! never governed.

use crate::effects::{Action, Direction, Effect, Reaction};
use crate::fleet::ask::FleetAsk;
use crate::headers::WireHeaders;
use crate::metrics::{Counter, Metrics};
use crate::reply::LocalReply;
use crate::request::Flow;
use crate::usage::UsageScanner;
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Error bodies are small; past this much, classify from what arrived.
pub const MAX_ERROR_BODY: usize = 16 * 1024;
/// How long a paused response waits for its error body before it is classified without one.
/// The first chunk of a request body read before admission must come as soon.
pub const BODY_WAIT_MS: u64 = 1000;
/// How long a local answer waits for the end of the request body before it is sent anyway (a
/// slow upload then gets its answer early, on a connection Envoy closes); and how long a
/// request whose body is read before admission waits for the rest once some arrived, before
/// it is estimated from what came.
pub const REQUEST_BODY_WAIT_MS: u64 = 10_000;
/// After a body never came, how long to stop pausing for bodies (Envoy is evidently configured
/// without `allow_on_headers_stop_iteration`), before trying again.
pub const HEADERS_ONLY_FOR_MS: u64 = 60_000;

/// Where one stream is: what it waits for, and what it carries to its next callback.
#[derive(Debug)]
pub(crate) enum Stream {
    /// Its body is read before admission (a limit reserves tokens or keys by model).
    ReadingBody(BodyRead),
    /// Held in `Holds`; whether its request body has ended.
    Held { body_ended: bool },
    /// A local answer waits for the end of the request body: answering before the body is
    /// read makes Envoy close an HTTP/1.1 connection, and every local 429 would then cost the
    /// client a new connection (and TLS handshake).
    ReplyPending { reply: LocalReply, until_ms: u64 },
    /// It went upstream with this flow; a scanner reads the usage of a success that charges.
    Upstream {
        flow: Flow,
        usage: Option<UsageScanner>,
    },
    /// An upstream error response waits for its body to be classified; `arrived` is what of
    /// it body callbacks delivered so far.
    AwaitingErrorBody {
        flow: Flow,
        status: u16,
        headers: WireHeaders,
        until_ms: u64,
        arrived: Vec<u8>,
    },
    /// Admitted locally, it waits for the fleet's service to answer for its fleet limits.
    AwaitingFleet {
        flow: Flow,
        body_ended: bool,
        ask: FleetAsk,
    },
}

impl Stream {
    pub(crate) fn fleet(flow: Flow, body_ended: bool, ask: FleetAsk) -> Stream {
        Stream::AwaitingFleet {
            flow,
            body_ended,
            ask,
        }
    }

    /// When its wait is overdue, for the states that wait on time.
    fn until_ms(&self) -> Option<u64> {
        match self {
            Stream::ReadingBody(read) => Some(read.until_ms),
            Stream::ReplyPending { until_ms, .. } | Stream::AwaitingErrorBody { until_ms, .. } => {
                Some(*until_ms)
            }
            Stream::AwaitingFleet { ask, .. } => Some(ask.until_ms()),
            // A fleet slot's hold is taken again while the stream lasts.
            Stream::Upstream { flow, .. } => flow.slot_renewal_ms(),
            Stream::Held { .. } => None,
        }
    }

    fn stage(&self) -> Stage {
        match self {
            Stream::ReadingBody(_) => Stage::ReadingBody,
            Stream::Held { .. } => Stage::Held,
            Stream::ReplyPending { .. } => Stage::ReplyPending,
            Stream::Upstream { .. } => Stage::Upstream,
            Stream::AwaitingErrorBody { .. } => Stage::AwaitingErrorBody,
            Stream::AwaitingFleet { .. } => Stage::AwaitingFleet,
        }
    }

    /// Whether the request's body has ended, for the states that keep the request paused.
    pub(crate) fn body_ended(&mut self) -> Option<&mut bool> {
        match self {
            Stream::Held { body_ended } | Stream::AwaitingFleet { body_ended, .. } => {
                Some(body_ended)
            }
            _ => None,
        }
    }
}

/// A request paused for its body: its flow and declared length, and whether any of the body
/// has reached the filter (until then it waits `BODY_WAIT_MS`: without
/// `allow_on_headers_stop_iteration` Envoy delivers none).
#[derive(Debug)]
pub(crate) struct BodyRead {
    pub(crate) flow: Flow,
    pub(crate) content_length: usize,
    pub(crate) until_ms: u64,
    pub(crate) seen: bool,
}

impl BodyRead {
    pub(crate) fn new(flow: Flow, content_length: usize, until_ms: u64) -> BodyRead {
        BodyRead {
            flow,
            content_length,
            until_ms,
            seen: false,
        }
    }

    /// How much of the body to read (`size` buffered in all, when a body callback said).
    pub(crate) fn bound(size: Option<usize>) -> usize {
        size.unwrap_or(crate::estimate::MAX_BODY)
            .min(crate::estimate::MAX_BODY)
    }

    /// The flow, estimated from the `prefix` of its body Envoy buffered.
    pub(crate) fn estimated(
        self,
        pools: crate::pools::Pools,
        prefix: &[u8],
        size: Option<usize>,
    ) -> Flow {
        let total = size.unwrap_or(prefix.len()).max(self.content_length);
        let mut flow = self.flow;
        pools.on_request_body(&mut flow, prefix, total);
        flow
    }
}

/// An awaited error body: what Envoy buffers, or what body callbacks delivered when that is
/// more, at most `MAX_ERROR_BODY`.
pub(crate) fn error_body(buffered: Vec<u8>, arrived: Vec<u8>) -> Vec<u8> {
    let mut body = if buffered.len() < arrived.len() {
        arrived
    } else {
        buffered
    };
    body.truncate(MAX_ERROR_BODY);
    body
}

/// Whether Envoy delivers body callbacks after a paused headers callback (it does not without
/// `allow_on_headers_stop_iteration`). Assumed until a body that was waited for never came;
/// then, for `HEADERS_ONLY_FOR_MS`, nothing waits for a body. Once a paused stream has had a
/// body callback, the capability is proven: a body that is late afterwards is that stream's
/// slowness, and changes how no other stream is read.
#[derive(Default)]
pub(crate) struct BodyCapability {
    pub(crate) headers_only_until: u64,
    pub(crate) proven: bool,
    pub(crate) warned: bool,
}

impl BodyCapability {
    pub(crate) fn expected(&self, now: impl FnOnce() -> u64) -> bool {
        self.headers_only_until == 0 || now() >= self.headers_only_until
    }

    /// A paused stream had a body callback.
    pub(crate) fn seen(&mut self) {
        self.proven = true;
        self.headers_only_until = 0;
    }

    /// A body waited for never came (and none ever did): for `HEADERS_ONLY_FOR_MS`, nothing
    /// waits for one. Counted on `pool`; said once in the log.
    pub(crate) fn missed(&mut self, pool: usize, now: u64, metrics: &mut dyn Metrics) {
        self.headers_only_until = now + HEADERS_ONLY_FOR_MS;
        metrics.count(pool, Counter::BodyUnavailable);
        if !std::mem::replace(&mut self.warned, true) {
            log::warn!(
                "llm_governor: a held body never arrived; for a minute, errors are classified from \
                 status and headers alone and token limits charge after the response instead of \
                 reserving. In the proxy-wasm module, set allow_on_headers_stop_iteration: true \
                 in the plugin config so quota errors can be told from rate limits and requests \
                 can be estimated"
            );
        }
    }
}

/// Context ids are small integers handed out in order: a multiply spreads them.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8 | u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, n: u32) {
        let h = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
}

/// A worker's streams by id, and (until, id) of every one that waits on time.
#[derive(Default)]
pub(crate) struct Streams {
    map: HashMap<u32, Stream, BuildHasherDefault<IdHasher>>,
    due: BTreeSet<(u64, u32)>,
}

impl Streams {
    pub(crate) fn get(&self, id: u32) -> Option<&Stream> {
        self.map.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: u32) -> Option<&mut Stream> {
        self.map.get_mut(&id)
    }

    /// Put stream `id` in `state`, keeping the waits' deadlines in step.
    pub(crate) fn set(&mut self, id: u32, state: Stream) {
        if let Some(until) = state.until_ms() {
            self.due.insert((until, id));
        }
        if let Some(old) = self.map.insert(id, state) {
            if let Some(until) = old.until_ms() {
                self.due.remove(&(until, id));
            }
        }
    }

    /// Take stream `id` out of the table (it is done unless put back).
    pub(crate) fn take(&mut self, id: u32) -> Option<Stream> {
        let stream = self.map.remove(&id)?;
        if let Some(until) = stream.until_ms() {
            self.due.remove(&(until, id));
        }
        Some(stream)
    }

    /// Take stream `id` when it waits for the fleet: its flow, whether its body ended, its ask.
    pub(crate) fn take_fleet(&mut self, id: u32) -> Option<(Flow, bool, FleetAsk)> {
        if !matches!(self.map.get(&id), Some(Stream::AwaitingFleet { .. })) {
            return None;
        }
        match self.take(id)? {
            Stream::AwaitingFleet {
                flow,
                body_ended,
                ask,
            } => Some((flow, body_ended, ask)),
            _ => None,
        }
    }

    /// Take stream `id` when it is held: whether its body ended.
    pub(crate) fn take_held(&mut self, id: u32) -> bool {
        matches!(self.take(id), Some(Stream::Held { body_ended: true }))
    }

    /// Take stream `id` when a local answer waits for its body: the answer.
    pub(crate) fn take_pending(&mut self, id: u32) -> Option<LocalReply> {
        if !matches!(self.map.get(&id), Some(Stream::ReplyPending { .. })) {
            return None;
        }
        match self.take(id)? {
            Stream::ReplyPending { reply, .. } => Some(reply),
            _ => None,
        }
    }

    /// An upstream stream's error response waits for its body until `until_ms`.
    pub(crate) fn await_error_body(
        &mut self,
        id: u32,
        status: u16,
        headers: WireHeaders,
        until_ms: u64,
    ) {
        if let Some(Stream::Upstream { flow, .. }) = self.take(id) {
            let arrived = Vec::new();
            let wait = Stream::AwaitingErrorBody {
                flow,
                status,
                headers,
                until_ms,
                arrived,
            };
            self.set(id, wait);
        }
    }

    /// Answer stream `id` locally: at once (`now`: its request body has ended, or body callbacks
    /// do not come), else once its body has ended (`ReplyPending` until `until_ms`), dropping
    /// the `buffered` bytes Envoy holds for it so far.
    pub(crate) fn answer(
        &mut self,
        id: u32,
        reply: LocalReply,
        now: bool,
        buffered: usize,
        until_ms: impl FnOnce() -> u64,
    ) -> Reaction {
        let mut effects = vec![Effect::AccessLog(crate::reply::access_log(&reply.headers))];
        if now {
            effects.push(Effect::SendReply(reply));
        } else {
            if buffered > 0 {
                effects.push(Effect::DropRequestBody(buffered));
            }
            let until_ms = until_ms();
            self.set(id, Stream::ReplyPending { reply, until_ms });
        }
        Reaction::new(effects, Action::Pause)
    }

    /// Some of the request body of a stream whose local answer waits for it (`size` buffered,
    /// or its end): the answer once it has ended, meanwhile what arrives dropped.
    pub(crate) fn pending_body(&mut self, id: u32, size: Option<usize>, ended: bool) -> Reaction {
        if ended {
            return match self.take_pending(id) {
                Some(reply) => Reaction::new(vec![Effect::SendReply(reply)], Action::Pause),
                None => Reaction::go_on(),
            };
        }
        let drop = size.filter(|n| *n > 0).map(Effect::DropRequestBody);
        Reaction::new(drop.into_iter().collect(), Action::Pause)
    }

    /// Change the flow of upstream stream `id` with `f` (None: it is not upstream), keeping its
    /// wait's deadline (a fleet slot's renewal) in step.
    pub(crate) fn with_upstream<T>(
        &mut self,
        id: u32,
        f: impl FnOnce(&mut Flow) -> T,
    ) -> Option<T> {
        let Some(Stream::Upstream { flow, .. }) = self.map.get_mut(&id) else {
            return None;
        };
        if let Some(old) = flow.slot_renewal_ms() {
            self.due.remove(&(old, id));
        }
        let out = f(flow);
        if let Some(until) = flow.slot_renewal_ms() {
            self.due.insert((until, id));
        }
        Some(out)
    }

    /// Move the deadline of a `ReadingBody` stream (some of its body came).
    pub(crate) fn read_longer(&mut self, id: u32, until: u64) {
        if let Some(Stream::ReadingBody(read)) = self.map.get_mut(&id) {
            let old = std::mem::replace(&mut read.until_ms, until);
            self.due.remove(&(old, id));
            self.due.insert((until, id));
        }
    }

    /// The earliest wait's deadline.
    pub(crate) fn next_due_ms(&self) -> Option<u64> {
        self.due.first().map(|(until, _)| *until)
    }

    /// The stream whose wait is overdue at `now`, earliest first, taken off the due list (its
    /// state stays for the caller to read).
    pub(crate) fn pop_due(&mut self, now: u64) -> Option<u32> {
        let &(until, id) = self.due.first()?;
        (until <= now).then(|| {
            self.due.pop_first();
            id
        })
    }

    pub(crate) fn waits(&self) -> bool {
        !self.due.is_empty()
    }

    pub(crate) fn stage(&self, id: u32) -> Stage {
        self.map.get(&id).map_or(Stage::Done, Stream::stage)
    }

    /// The flow of a stream that went upstream (or whose error body is awaited).
    pub(crate) fn flow(&self, id: u32) -> Option<&Flow> {
        match self.map.get(&id)? {
            Stream::Upstream { flow, .. } | Stream::AwaitingErrorBody { flow, .. } => Some(flow),
            _ => None,
        }
    }

    /// Whether a body callback of this direction would do anything for stream `id` now.
    pub(crate) fn reads_body(&self, id: u32, direction: Direction) -> bool {
        let request = direction == Direction::Request;
        match self.map.get(&id) {
            Some(
                Stream::ReadingBody(_)
                | Stream::Held { .. }
                | Stream::AwaitingFleet { .. }
                | Stream::ReplyPending { .. },
            ) => request,
            Some(Stream::Upstream { usage, .. }) => !request && usage.is_some(),
            Some(Stream::AwaitingErrorBody { .. }) => !request,
            None => false,
        }
    }
}

/// Where a stream is, as a value a test or a log line can show.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    ReadingBody,
    Held,
    ReplyPending,
    Upstream,
    AwaitingErrorBody,
    AwaitingFleet,
    /// Not tracked: answered locally, ended, or never governed.
    Done,
}

/// Where a request stands when admission decides it: its body ended, how much of it Envoy
/// holds for the filter now, and whether the request is paused outside its own callback (a
/// tick, an answer of the service: it must be resumed to go).
#[derive(Clone, Copy)]
pub struct At {
    pub body_ended: bool,
    pub buffered: usize,
    pub from_tick: bool,
}

impl At {
    /// In its arrival callback.
    pub fn arrived(body_ended: bool) -> At {
        At {
            body_ended,
            buffered: 0,
            from_tick: false,
        }
    }

    /// Outside its own callbacks.
    pub fn paused(body_ended: bool) -> At {
        At {
            from_tick: true,
            ..At::arrived(body_ended)
        }
    }
}
