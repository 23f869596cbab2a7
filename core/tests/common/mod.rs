//! A builder-style fake host for the pure core: in-memory shared data with Envoy's semantics,
//! recorded metrics, fixed randomness, a clock the test drives, and stream buffers the test
//! fills. Requests go through the `Worker`, the entry points every host calls.
#![allow(dead_code)]

use llm_governor_core::bucket::{Bucket, Shape};
use llm_governor_core::config;
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub mod props;
pub mod race;

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

/// What became of a request the test sent (or a tick let go).
#[derive(Debug)]
pub enum Step {
    /// It went upstream, with this flow (a copy: the worker keeps the stream's own).
    Go(Flow),
    /// It is held.
    Held,
    /// It was answered locally.
    Reply(LocalReply),
}

/// What `Host::request` decided for a request that may not be held.
#[derive(Debug)]
pub enum Decision {
    Forward(Flow),
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
    /// Leases for calls that go to the governor directly (`with_env`): another worker's.
    pub leases: Leases,
    next_id: u32,
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
        let cfg = match config::parse(config_json.as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("test config rejected: {e}"),
        };
        let rng = FixedRng::new(0.0);
        Host {
            worker: Worker::with_random(
                Arc::new(Governor::new(cfg, test_key())),
                Box::new(rng.clone()),
            ),
            store: MemStore::new(),
            metrics: Recorded::default(),
            rng,
            io: FakeIo::default(),
            now_ms: T0,
            clock_reads: Cell::new(0),
            leases: Leases::default(),
            next_id: AUTO_IDS,
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
    pub fn forward_with_body(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Flow {
        forwarded(self.request_with_body(path, headers, body))
    }

    /// Send a request; panics unless it is forwarded.
    pub fn forward(&mut self, path: &str, headers: &[(&str, &str)]) -> Flow {
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

    /// Request headers, then (if any) the whole body in one callback: what became of it.
    fn send(&mut self, id: u32, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Step {
        let hs = owned(headers);
        let v = view(path, &hs);
        let eos = body.is_none();
        let mut r = self.call(|w, lent| w.on_request_headers(id, &v, eos, lent));
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
                Some(f) => Step::Go(f.clone()),
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

    /// A held client went away: its stream ended.
    pub fn leave(&mut self, id: u32) {
        self.call(|w, lent| w.on_end(id, lent));
    }

    /// The stream `id` ended (however it ended).
    pub fn end_stream(&mut self, id: u32) {
        self.call(|w, lent| w.on_end(id, lent));
    }

    /// The stream of `flow` ended with the provider reporting `usage` tokens in all.
    pub fn end_with_usage(&mut self, flow: &mut Flow, usage: u64) {
        let usage = llm_governor_core::usage::Usage {
            total: Some(usage),
            ..Default::default()
        };
        self.end_with(flow, usage);
    }

    /// The stream of `flow` ended with the provider reporting `usage`.
    pub fn end_with(&mut self, flow: &mut Flow, usage: llm_governor_core::usage::Usage) {
        self.with_env(|g, env| g.responses().on_stream_end(flow, Some(usage), env));
    }

    /// A complete response: headers, then (if held) the body. Returns what the client sees.
    /// The flow is the test's copy: its pace and slot bookkeeping stay as they were.
    pub fn respond(
        &mut self,
        flow: &Flow,
        status: u16,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Option<Governed> {
        self.answer(&mut flow.clone(), status, headers, body)
    }

    /// A response to a flow the test keeps (its pace and slot bookkeeping move with it).
    pub fn answer(
        &mut self,
        flow: &mut Flow,
        status: u16,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Option<Governed> {
        let hs = owned(headers);
        self.with_env(|governor, env| {
            let responses = governor.responses();
            let headers = Headers::new(&hs);
            let eos = body.is_empty();
            let decided = responses.on_headers(flow, status, &headers, eos, &mut || true, env);
            match decided.step {
                ResponseStep::Pass => None,
                ResponseStep::Rewrite(g) => Some(g),
                ResponseStep::NeedBody => {
                    responses.on_error_body(flow, status, &headers, body.as_bytes(), env)
                }
            }
        })
    }

    /// The response to stream `id` as Envoy delivers it to the worker: headers (with
    /// `:status`), then the body in one callback if there is one. The reactions, in order.
    pub fn stream_response(
        &mut self,
        id: u32,
        status: u16,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Vec<Reaction> {
        let status = status.to_string();
        let mut all = vec![(":status", status.as_str())];
        all.extend_from_slice(headers);
        let hs = owned(&all);
        let eos = body.is_empty();
        let mut out =
            vec![self.call(|w, lent| w.on_response_headers(id, &Headers::new(&hs), eos, lent))];
        if !eos {
            self.io.response_bodies.insert(id, body.as_bytes().to_vec());
            let n = body.len();
            out.push(self.call(|w, lent| w.on_response_body(id, n, true, lent)));
        }
        out
    }

    /// The stream of `flow` ended (however it ended).
    pub fn end(&mut self, flow: &mut Flow) {
        self.with_env(|g, env| g.responses().on_stream_end(flow, None, env));
    }

    /// Call the governor directly with this host's environment (and leases of its own).
    pub fn with_env<T>(&mut self, f: impl FnOnce(&Governor, &mut Env) -> T) -> T {
        let now = self.now_ms;
        let (g, mut env) = self.parts_with(Clock::At(now));
        f(g, &mut env)
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
}

/// A request to api.example.com at `path` with headers `hs`.
pub fn view<'a>(path: &'a str, hs: &'a [(String, Vec<u8>)]) -> RequestView<'a> {
    RequestView {
        path: path.as_bytes(),
        authority: b"api.example.com",
        headers: Headers::new(hs),
    }
}

/// The flow of a forwarded request; panics on a local reply.
fn forwarded(d: Decision) -> Flow {
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

/// The flows a tick let go, by id.
pub fn flows(left: Vec<(u32, Step)>) -> Vec<(u32, Flow)> {
    left.into_iter()
        .filter_map(|(id, s)| match s {
            Step::Go(f) => Some((id, f)),
            _ => None,
        })
        .collect()
}

/// The flow of a request that went at once; panics otherwise.
pub fn go(step: Step) -> Flow {
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
