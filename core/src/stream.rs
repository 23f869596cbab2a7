//! One stream's state in its worker, from its first callback to its end: what it waits for,
//! until when, and what it carries to its next callback.

use crate::fleet::{Ask, Said};
use crate::flow::Flow;
use crate::headers::WireHeaders;
use crate::reply::LocalReply;
use crate::usage::UsageScanner;
use std::collections::HashMap;
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
    AwaitingFleet(FleetWait),
}

/// A request whose fleet limits were asked: the calls (`first_seq` on, one per ask), what each
/// answer said so far, and what the request needs when they are all in (or overdue).
#[derive(Debug)]
pub(crate) struct FleetWait {
    pub(crate) flow: Flow,
    pub(crate) budget_ms: u64,
    pub(crate) body_ended: bool,
    pub(crate) sent_ms: u64,
    pub(crate) until_ms: u64,
    pub(crate) first_seq: u32,
    pub(crate) asks: Vec<Ask>,
    /// How many of `asks` were sent: the first stage (`fleet::first_stage`), then all.
    pub(crate) sent: usize,
    pub(crate) said: Vec<Option<Said>>,
}

impl Stream {
    /// When its wait is overdue, for the states that wait on time.
    pub(crate) fn until_ms(&self) -> Option<u64> {
        match self {
            Stream::ReadingBody(read) => Some(read.until_ms),
            Stream::ReplyPending { until_ms, .. } | Stream::AwaitingErrorBody { until_ms, .. } => {
                Some(*until_ms)
            }
            Stream::AwaitingFleet(w) => Some(w.until_ms),
            Stream::Held { .. } | Stream::Upstream { .. } => None,
        }
    }
}

/// A request paused for its body: its flow, hold budget and declared length, and whether any
/// of the body has reached the filter (until then it waits `BODY_WAIT_MS`: without
/// `allow_on_headers_stop_iteration` Envoy delivers none).
#[derive(Debug)]
pub(crate) struct BodyRead {
    pub(crate) flow: Flow,
    pub(crate) budget_ms: u64,
    pub(crate) content_length: usize,
    pub(crate) until_ms: u64,
    pub(crate) seen: bool,
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
}

/// Context ids are small integers handed out in order: a multiply spreads them.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

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

pub(crate) type Streams = HashMap<u32, Stream, BuildHasherDefault<IdHasher>>;

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
