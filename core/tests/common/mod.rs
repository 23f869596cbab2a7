//! A builder-style fake host for the pure core: in-memory shared data with Envoy's semantics,
//! recorded metrics, fixed randomness, a clock the test drives, and stream buffers the test
//! fills. Requests and responses go through the `Worker`, the entry points every host calls;
//! `workers` drives several of them over one store.
#![allow(dead_code)]

pub mod props;
pub mod provider;
pub mod race;
pub mod reactions;
pub mod workers;

use provider::{usage_body, A, PATH, RL};
use reactions::{told, Told};

use llm_governor_core::bucket::{Bucket, Shape};
use llm_governor_core::config;
use llm_governor_core::effects::TICK_MS;
use llm_governor_core::fleet::grpc::ServiceReply;
use llm_governor_core::headers::{owned, Headers};
use llm_governor_core::keys::{self, HashKey};
use llm_governor_core::lease::Leases;
use llm_governor_core::metrics::Recorded;
use llm_governor_core::policy::{Clock, Env, Flow, Governed, Governor, RequestView, ResponseStep};
use llm_governor_core::reply::LocalReply;
use llm_governor_core::retry_after::Random;
use llm_governor_core::store::{MemStore, SharedStore};
use llm_governor_core::worker::{Action, Effect, Lent, Reaction, Stage, StreamIo, Worker};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Always returns the same value in [0, 1); clones share it, so a test can change what the
/// worker draws (`host.rng.set(0.5)`).
#[derive(Clone, Default)]
pub struct FixedRng(Arc<AtomicU64>);

impl FixedRng {
    pub fn new(u: f64) -> FixedRng {
        FixedRng(Arc::new(AtomicU64::new(u.to_bits())))
    }

    pub fn set(&self, u: f64) {
        self.0.store(u.to_bits(), Ordering::Relaxed);
    }
}

impl Random for FixedRng {
    fn unit(&mut self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// The streams' buffers as the test filled them, and which responses Envoy made itself.
#[derive(Default)]
pub struct FakeIo {
    pub request_bodies: HashMap<u32, Vec<u8>>,
    pub response_bodies: HashMap<u32, Vec<u8>>,
    pub from_envoy: HashSet<u32>,
}

impl StreamIo for FakeIo {
    fn request_body(&mut self, id: u32, max: usize) -> Vec<u8> {
        let b = self.request_bodies.get(&id).map_or(&[][..], |b| b);
        b[..b.len().min(max)].to_vec()
    }

    fn response_body(&mut self, id: u32, max: usize) -> Vec<u8> {
        let b = self.response_bodies.get(&id).map_or(&[][..], |b| b);
        b[..b.len().min(max)].to_vec()
    }

    fn answered_by_upstream(&mut self, id: u32) -> bool {
        !self.from_envoy.contains(&id)
    }
}

/// A request that went upstream: its stream, and its flow as it left (a copy: the worker keeps
/// the stream's own, which `Host::flow` reads). Responses and ends go to its stream.
#[derive(Clone, Debug)]
pub struct Sent {
    pub id: u32,
    pub flow: Flow,
}

impl Deref for Sent {
    type Target = Flow;

    fn deref(&self) -> &Flow {
        &self.flow
    }
}

/// A stream the test names: by its id, or by the request that went upstream on it.
pub trait StreamId {
    fn stream_id(&self) -> u32;
}

impl StreamId for u32 {
    fn stream_id(&self) -> u32 {
        *self
    }
}

impl StreamId for &Sent {
    fn stream_id(&self) -> u32 {
        self.id
    }
}

/// What became of a request the test sent (or a tick let go). (A test value, moved once or
/// twice: its size does not matter.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Step {
    /// It went upstream.
    Go(Sent),
    /// It is held.
    Held,
    /// It was answered locally.
    Reply(LocalReply),
}

/// What `Host::request` decided for a request that may not be held.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Decision {
    Forward(Sent),
    Reply(LocalReply),
}

pub struct Host {
    pub worker: Worker,
    pub store: MemStore,
    pub metrics: Recorded,
    /// What the worker draws; `set` changes it.
    pub rng: FixedRng,
    pub io: FakeIo,
    pub now_ms: u64,
    /// How often the worker read the clock.
    pub clock_reads: Cell<u32>,
    /// Leases for calls that go to a job's type directly (`parts_with`): another worker's.
    pub leases: Leases,
    next_id: u32,
    /// Streams that have had their response (until they end): a real stream gets one.
    responded: HashSet<u32>,
}

pub const T0: u64 = 1_796_055_600_000; // 2026-11-30T16:20:00Z

/// The key of the tests' ids (a host's is secret: the environment's or an Envoy-wide random one).
pub const TEST_KEY: (u64, u64) = (0x7465_7374, 0x006b_6579);

pub fn test_key() -> HashKey {
    HashKey::from_words(TEST_KEY.0, TEST_KEY.1)
}

/// Streams the test numbers itself use ids below this; `request` and `forward` count from it.
const AUTO_IDS: u32 = 1_000_000;

impl Host {
    pub fn new(config_json: &str) -> Host {
        let rng = FixedRng::new(0.0);
        Host {
            worker: Worker::with_random(governor(config_json), Box::new(rng.clone())),
            store: MemStore::new(),
            metrics: Recorded::default(),
            rng,
            io: FakeIo::default(),
            now_ms: T0,
            clock_reads: Cell::new(0),
            leases: Leases::default(),
            next_id: AUTO_IDS,
            responded: HashSet::new(),
        }
    }

    pub fn governor(&self) -> &Governor {
        self.worker.governor()
    }

    /// Call the worker with this host's store, metrics, clock and buffers.
    pub fn call<T>(&mut self, f: impl FnOnce(&mut Worker, &mut Lent) -> T) -> T {
        let Host {
            worker,
            store,
            metrics,
            io,
            now_ms,
            clock_reads,
            ..
        } = self;
        let now = *now_ms;
        let clock = || {
            clock_reads.set(clock_reads.get() + 1);
            now
        };
        let mut lent = Lent {
            store,
            metrics,
            clock: &clock,
            io,
        };
        f(worker, &mut lent)
    }

    fn next_id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    /// A request through the worker from a client whose deadline leaves no time to hold it
    /// (`x-envoy-expected-rq-timeout-ms: 0`): forwarded or answered at once.
    pub fn request(&mut self, path: &str, headers: &[(&str, &str)]) -> Decision {
        self.request_as(path, headers, None)
    }

    /// `request` with a body that is read before admission when a limit needs it.
    pub fn request_with_body(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Decision {
        self.request_as(path, headers, Some(body))
    }

    fn request_as(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Decision {
        let mut hs = headers.to_vec();
        hs.push(("x-envoy-expected-rq-timeout-ms", "0"));
        let id = self.next_id();
        match self.send(id, path, &hs, body) {
            Step::Go(flow) => Decision::Forward(flow),
            Step::Reply(r) => Decision::Reply(r),
            Step::Held => panic!("a request with no time to hold was held"),
        }
    }

    /// `request_with_body`; panics unless it is forwarded.
    pub fn forward_with_body(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Sent {
        forwarded(self.request_with_body(path, headers, body))
    }

    /// Send a request; panics unless it is forwarded.
    pub fn forward(&mut self, path: &str, headers: &[(&str, &str)]) -> Sent {
        forwarded(self.request(path, headers))
    }

    /// A request as Envoy hands it to the worker, as stream `id`; held when it must wait.
    pub fn arrive(&mut self, id: u32, path: &str, headers: &[(&str, &str)]) -> Step {
        self.send(id, path, headers, None)
    }

    /// `arrive` with a body (read before admission when a limit needs it).
    pub fn arrive_with_body(
        &mut self,
        id: u32,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Step {
        self.send(id, path, headers, Some(body))
    }

    /// Request headers of stream `id` at `PATH` (a body to come unless `eos`): the reaction.
    pub fn request_headers(&mut self, id: u32, headers: &[(&str, &str)], eos: bool) -> Reaction {
        let hs = owned(headers);
        self.call(|w, lent| arrive_headers(w, lent, id, PATH, &hs, eos))
    }

    /// Request headers, then (if any) the whole body in one callback: what became of it.
    fn send(&mut self, id: u32, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Step {
        let hs = owned(headers);
        let eos = body.is_none();
        let mut r = self.call(|w, lent| arrive_headers(w, lent, id, path, &hs, eos));
        if let Some(b) = body {
            self.io.request_bodies.insert(id, b.to_vec());
            if r.action == Action::Pause && self.worker.stage(id) != Stage::Held {
                let n = b.len();
                r = self.call(|w, lent| w.on_request_body(id, n, true, lent));
            }
        }
        self.step(id, r)
    }

    /// What a reaction did to stream `id`.
    fn step(&self, id: u32, r: Reaction) -> Step {
        for e in &r.effects {
            if let Effect::SendReply(reply) = e {
                return Step::Reply(reply.clone());
            }
        }
        let resumed = r.effects.contains(&Effect::ResumeRequest);
        if r.action == Action::Continue || resumed {
            return match self.worker.flow(id) {
                Some(f) => Step::Go(Sent {
                    id,
                    flow: f.clone(),
                }),
                None => panic!("stream {id} went on with no flow: {r:?}"),
            };
        }
        match self.worker.stage(id) {
            Stage::Held => Step::Held,
            other => panic!("stream {id} paused in {other:?}: {r:?}"),
        }
    }

    /// The worker's tick at the current time: what became of each stream it let go.
    pub fn tick(&mut self) -> Vec<(u32, Step)> {
        let out = self.call(|w, lent| w.tick(lent));
        out.into_iter()
            .map(|(id, r)| (id, self.step(id, r)))
            .collect()
    }

    /// The worker's tick, as reactions.
    pub fn tick_reactions(&mut self) -> Vec<(u32, Reaction)> {
        self.call(|w, lent| w.tick(lent))
    }

    /// The stream ended (however it ended: complete, reset, or a held client gone).
    pub fn end(&mut self, stream: impl StreamId) {
        let id = stream.stream_id();
        self.call(|w, lent| w.on_end(id, lent));
        self.responded.remove(&id);
    }

    /// The stream ends after a success whose body reports `tokens` used, as its provider
    /// reports them (the worker reads them when the request is charged its usage).
    pub fn end_with_usage(&mut self, stream: impl StreamId, tokens: u64) {
        let id = stream.stream_id();
        let dialect = self.flow(id).dialect;
        let body = usage_body(dialect, tokens);
        self.respond(id, 200, &[("content-type", "application/json")], &body);
        self.end(id);
    }

    /// The response to a stream that went upstream, through the worker. What the client is
    /// told, when the worker governed it.
    pub fn respond(
        &mut self,
        stream: impl StreamId,
        status: u16,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Option<Told> {
        told(&self.response(stream, status, headers, body))
    }

    /// The response to a stream that went upstream as Envoy delivers it to the worker: headers
    /// (with `:status`), then the body in one callback if there is one. The reactions, in order.
    pub fn response(
        &mut self,
        stream: impl StreamId,
        status: u16,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Vec<Reaction> {
        self.response_wire(stream, status, &owned(headers), body.as_bytes())
    }

    /// `response` with header values and a body of any bytes.
    pub fn response_wire(
        &mut self,
        stream: impl StreamId,
        status: u16,
        headers: &[(String, Vec<u8>)],
        body: &[u8],
    ) -> Vec<Reaction> {
        let id = stream.stream_id();
        assert_eq!(
            self.worker.stage(id),
            Stage::Upstream,
            "a response comes to a request that went upstream (stream {id})"
        );
        assert!(
            self.responded.insert(id),
            "stream {id} already had its response: send another request"
        );
        self.io.response_bodies.insert(id, body.to_vec());
        self.call(|w, lent| deliver_response(w, lent, id, status, headers, body.len()))
    }

    /// The worker's own flow of a stream (it moves with the stream; `Sent` keeps a copy).
    pub fn flow(&self, stream: impl StreamId) -> &Flow {
        let id = stream.stream_id();
        self.worker
            .flow(id)
            .unwrap_or_else(|| panic!("stream {id} is not upstream"))
    }

    /// A unit test of the response room alone (`response::Responses`), without the worker: what
    /// it decides for a copy of `flow` on this response, its body read whole. Only for what the
    /// client cannot see (the provider's own time); everything else goes through `respond`.
    pub fn response_room(
        &mut self,
        flow: &Flow,
        status: u16,
        headers: &[(String, Vec<u8>)],
        body: &[u8],
    ) -> Option<Governed> {
        let flow = &mut flow.clone();
        let now = self.now_ms;
        let (governor, mut env) = self.parts_with(Clock::At(now));
        let (responses, headers) = (governor.responses(), Headers::new(headers));
        let eos = body.is_empty();
        let decided = responses.on_headers(flow, status, &headers, eos, &mut || true, &mut env);
        match decided.step {
            ResponseStep::NeedBody => {
                responses.on_error_body(flow, status, &headers, body, &mut env)
            }
            ResponseStep::Rewrite(g) => Some(g),
            ResponseStep::Pass => None,
        }
    }

    /// The governor and an environment with the time from `clock`.
    pub fn parts_with<'c>(&'c mut self, clock: Clock<'c>) -> (&'c Governor, Env<'c>) {
        let Host {
            worker,
            store,
            metrics,
            rng,
            leases,
            ..
        } = self;
        let env = Env {
            store,
            metrics,
            rng,
            leases,
            clock,
        };
        (worker.governor(), env)
    }

    /// Whole tokens (rounded down) in the bucket of limit `limit` for key id `key_id`, brought
    /// up to now; None when no request has written it yet.
    pub fn bucket_tokens(&self, limit: usize, key_id: u64) -> Option<i64> {
        let l = &self.governor().cfg.limits[limit];
        let (bytes, _) = self.store.get(&keys::bucket_key(&l.name, key_id)).ok()??;
        let b = Bucket::decode(&bytes)?;
        Some(b.refill(Shape::from(l), self.now_ms).tokens())
    }

    pub fn advance(&mut self, ms: u64) {
        self.now_ms += ms;
    }

    /// What the fleet's service answered to call `seq` of stream `id` (sent as the host's
    /// token `seq`): the stream's reaction (a pause when it reacts to nothing).
    pub fn service_answer(&mut self, id: u32, seq: u32, reply: ServiceReply) -> Reaction {
        let token = u64::from(seq);
        self.worker.calls().sent(Some(id), token, seq);
        let r = self.call(|w, lent| w.on_call_done(Some(id), token, reply, lent));
        r.map_or(
            Reaction {
                effects: Vec::new(),
                action: Action::Pause,
            },
            |(_, r)| r,
        )
    }

    /// How many times counter `c` was counted.
    pub fn count(&self, c: llm_governor_core::metrics::Counter) -> usize {
        self.metrics
            .counters
            .iter()
            .filter(|(_, x)| *x == c)
            .count()
    }
}

/// Whether `needle` occurs in `hay`.
pub fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// A request to api.example.com at `path` with headers `hs`.
pub fn view<'a>(path: &'a str, hs: &'a [(String, Vec<u8>)]) -> RequestView<'a> {
    RequestView {
        path: path.as_bytes(),
        authority: b"api.example.com",
        headers: Headers::new(hs),
    }
}

/// Request headers of stream `id` at `path`, as Envoy hands them to the worker.
pub fn arrive_headers(
    w: &mut Worker,
    lent: &mut Lent,
    id: u32,
    path: &str,
    headers: &[(String, Vec<u8>)],
    eos: bool,
) -> Reaction {
    w.on_request_headers(id, &view(path, headers), eos, lent)
}

/// The response to stream `id` as Envoy delivers it to the worker: headers (with `:status`),
/// then, when `body_len` > 0, the body (in the host's buffer) in one callback. The reactions,
/// in order.
pub fn deliver_response(
    w: &mut Worker,
    lent: &mut Lent,
    id: u32,
    status: u16,
    headers: &[(String, Vec<u8>)],
    body_len: usize,
) -> Vec<Reaction> {
    let mut all = vec![(":status".to_string(), status.to_string().into_bytes())];
    all.extend_from_slice(headers);
    let eos = body_len == 0;
    let mut out = vec![w.on_response_headers(id, &Headers::new(&all), eos, lent)];
    if !eos {
        out.push(w.on_response_body(id, body_len, true, lent));
    }
    out
}

/// The configuration `json` as every worker shares it, its ids keyed with the tests' key.
pub fn governor(json: &str) -> Arc<Governor> {
    match config::parse(json.as_bytes()) {
        Ok(cfg) => Arc::new(Governor::new(cfg, test_key())),
        Err(e) => panic!("test config rejected: {e}"),
    }
}

/// Cool account A for `secs` with one upstream 429.
pub fn cool(host: &mut Host, secs: &str) {
    let f = host.forward(PATH, &[A]);
    host.respond(&f, 429, &[("retry-after", secs)], RL);
}

/// The request of a forwarded decision; panics on a local reply.
fn forwarded(d: Decision) -> Sent {
    match d {
        Decision::Forward(f) => f,
        Decision::Reply(r) => panic!("expected forward, got local reply {r:?}"),
    }
}

pub fn header<'a>(g: &'a [(&'static str, String)], name: &str) -> &'a str {
    g.iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("missing header {name}"))
}

/// Tick now, then every `TICK_MS` until a tick lets nothing go (a worker lets one release of
/// the pace go per (pool, account) and tick): everything that left, in order.
pub fn tick_all(host: &mut Host) -> Vec<(u32, Step)> {
    let mut all = host.tick();
    loop {
        host.advance(TICK_MS);
        let out = host.tick();
        if out.is_empty() {
            return all;
        }
        all.extend(out);
    }
}

/// The ids of the requests a tick let go, in order.
pub fn gone(left: &[(u32, Step)]) -> Vec<u32> {
    left.iter()
        .filter_map(|(id, s)| matches!(s, Step::Go(_)).then_some(*id))
        .collect()
}

/// The ids of the requests a tick answered locally, in order.
pub fn answered(left: &[(u32, Step)]) -> Vec<u32> {
    left.iter()
        .filter_map(|(id, s)| matches!(s, Step::Reply(_)).then_some(*id))
        .collect()
}

/// The requests a tick let go, by id.
pub fn flows(left: Vec<(u32, Step)>) -> Vec<(u32, Sent)> {
    left.into_iter()
        .filter_map(|(id, s)| match s {
            Step::Go(f) => Some((id, f)),
            _ => None,
        })
        .collect()
}

/// A request that went at once; panics otherwise.
pub fn go(step: Step) -> Sent {
    match step {
        Step::Go(f) => f,
        other => panic!("expected to go, got {other:?}"),
    }
}

// The rate-limit service's answers, as bytes (protobuf by hand).

/// A length-delimited protobuf field.
pub fn field(n: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![n << 3 | 2, bytes.len() as u8];
    out.extend_from_slice(bytes);
    out
}

/// `RateLimitResponse{overall_code}`, with Limitador's draft-03 reset header when given.
pub fn rls_answer(code: u8, reset_s: Option<u64>) -> Vec<u8> {
    let mut out = vec![0x08, code];
    if let Some(s) = reset_s {
        let header = [
            field(1, b"X-RateLimit-Reset"),
            field(2, s.to_string().as_bytes()),
        ]
        .concat();
        out.extend(field(3, &header));
    }
    out
}

pub fn reserve_answer(code: u8, id: &str) -> Vec<u8> {
    let mut out = vec![0x08, code];
    if !id.is_empty() {
        out.extend(field(2, id.as_bytes()));
    }
    out
}
