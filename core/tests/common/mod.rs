//! A builder-style fake host for the pure core: in-memory shared data with Envoy's semantics,
//! recorded metrics, fixed randomness and a clock the test drives.
#![allow(dead_code)]

use llm_governor_core::config;
use llm_governor_core::deadline;
use llm_governor_core::headers::{owned, Headers};
use llm_governor_core::hold::{Holds, Release, Step};
use llm_governor_core::metrics::Recorded;
use llm_governor_core::policy::{
    Clock, Env, Flow, Governed, Governor, RequestDecision, RequestView, ResponseStep,
};
use llm_governor_core::retry_after::Random;
use llm_governor_core::store::MemStore;

/// Always returns the same value in [0, 1).
pub struct FixedRng(pub f64);

impl Random for FixedRng {
    fn unit(&mut self) -> f64 {
        self.0
    }
}

pub struct Host {
    pub governor: Governor,
    /// One worker's held requests.
    pub holds: Holds,
    pub store: MemStore,
    pub metrics: Recorded,
    pub rng: FixedRng,
    pub now_ms: u64,
}

pub const T0: u64 = 1_796_055_600_000; // 2026-11-30T16:20:00Z

impl Host {
    pub fn new(config_json: &str) -> Host {
        let cfg = match config::parse(config_json.as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("test config rejected: {e}"),
        };
        Host {
            governor: Governor::new(cfg),
            holds: Holds::new(),
            store: MemStore::new(),
            metrics: Recorded::default(),
            rng: FixedRng(0.0),
            now_ms: T0,
        }
    }

    pub fn request(&mut self, path: &str, headers: &[(&str, &str)]) -> RequestDecision {
        self.decide(path, headers, None)
    }

    /// A request whose body the host read before admission (a limit reserves tokens).
    pub fn request_with_body(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> RequestDecision {
        self.decide(path, headers, Some(body))
    }

    fn decide(
        &mut self,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> RequestDecision {
        let hs = owned(headers);
        let view = view(path, &hs);
        let (governor, _, mut env) = self.parts();
        match body {
            Some(b) => governor.on_request_with_body(&view, b, b.len(), &mut env),
            None => governor.on_request(&view, &mut env),
        }
    }

    /// `request_with_body`; panics unless it is forwarded.
    pub fn forward_with_body(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Flow {
        forwarded(self.request_with_body(path, headers, body))
    }

    /// The stream of `flow` ended with the provider reporting `usage` tokens.
    pub fn end_with_usage(&mut self, flow: &mut Flow, usage: u64) {
        let (governor, _, mut env) = self.parts();
        governor.on_stream_end(flow, Some(usage), &mut env);
    }

    /// Send a request; panics unless it is forwarded.
    pub fn forward(&mut self, path: &str, headers: &[(&str, &str)]) -> Flow {
        forwarded(self.request(path, headers))
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

    /// A request as the host hands it to the hold state machine, with stream id `id`.
    pub fn arrive(&mut self, id: u32, path: &str, headers: &[(&str, &str)]) -> Step {
        self.arrive_as(id, path, headers, None)
    }

    /// `arrive` for a request whose body was read before admission.
    pub fn arrive_with_body(
        &mut self,
        id: u32,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Step {
        self.arrive_as(id, path, headers, Some(body))
    }

    fn arrive_as(
        &mut self,
        id: u32,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Step {
        let hs = owned(headers);
        let view = view(path, &hs);
        let (governor, holds, mut env) = self.parts();
        let mut flow = governor.flow_for(&view);
        if let Some(b) = body {
            governor.on_request_body(&mut flow, b, b.len());
        }
        let budget = deadline::hold_budget_ms(&governor.cfg.hold, &view.headers);
        holds.request(governor, flow, budget, id, &mut env)
    }

    /// Call the governor directly with this host's environment.
    pub fn with_env<T>(&mut self, f: impl FnOnce(&Governor, &mut Env) -> T) -> T {
        let (governor, _, mut env) = self.parts();
        f(governor, &mut env)
    }

    /// The worker's tick at the current time.
    pub fn tick(&mut self) -> Vec<Release> {
        let (governor, holds, mut env) = self.parts();
        holds.tick(governor, &mut env)
    }

    /// A held client went away.
    pub fn leave(&mut self, id: u32) -> Option<Flow> {
        let (_, holds, mut env) = self.parts();
        holds.forget(id, &mut env)
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
        let (governor, _, mut env) = self.parts();
        match governor.on_response_headers(
            flow,
            status,
            &Headers::new(&hs),
            body.is_empty(),
            true,
            &mut env,
        ) {
            ResponseStep::Pass => None,
            ResponseStep::Rewrite(g) => Some(g),
            ResponseStep::NeedBody => governor.on_response_body(
                flow,
                status,
                &Headers::new(&hs),
                body.as_bytes(),
                &mut env,
            ),
        }
    }

    /// The stream of `flow` ended (however it ended).
    pub fn end(&mut self, flow: &mut Flow) {
        let (governor, _, mut env) = self.parts();
        governor.on_stream_end(flow, None, &mut env);
    }

    /// The governor, this worker's holds, and the host environment at the current time.
    fn parts(&mut self) -> (&Governor, &mut Holds, Env<'_>) {
        let now = self.now_ms;
        self.parts_with(Clock::At(now))
    }

    /// `parts` with the environment's time from `clock`.
    pub fn parts_with<'c>(
        &'c mut self,
        clock: Clock<'c>,
    ) -> (&'c Governor, &'c mut Holds, Env<'c>) {
        let Host {
            governor,
            holds,
            store,
            metrics,
            rng,
            now_ms: _,
        } = self;
        let env = Env {
            store,
            metrics,
            rng,
            clock,
        };
        (governor, holds, env)
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
fn forwarded(d: RequestDecision) -> Flow {
    match d {
        RequestDecision::Forward(f) => f,
        RequestDecision::Reply(_, r) => panic!("expected forward, got local reply {r:?}"),
    }
}

pub fn header<'a>(g: &'a [(&'static str, String)], name: &str) -> &'a str {
    g.iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("missing header {name}"))
}

/// The ids of the requests a tick let go, in order.
pub fn gone(releases: &[Release]) -> Vec<u32> {
    releases
        .iter()
        .filter_map(|r| match r {
            Release::Go { id, .. } => Some(*id),
            Release::Reply { .. } => None,
        })
        .collect()
}

/// The ids of the requests a tick answered locally, in order.
pub fn answered(releases: &[Release]) -> Vec<u32> {
    releases
        .iter()
        .filter_map(|r| match r {
            Release::Reply { id, .. } => Some(*id),
            Release::Go { .. } => None,
        })
        .collect()
}

/// The flows a tick let go, by id.
pub fn flows(releases: Vec<Release>) -> Vec<(u32, Flow)> {
    releases
        .into_iter()
        .filter_map(|r| match r {
            Release::Go { id, flow } => Some((id, flow)),
            Release::Reply { .. } => None,
        })
        .collect()
}

/// The flow of a request the hold state machine let go at once; panics otherwise.
pub fn go(step: Step) -> Flow {
    match step {
        Step::Go(f) => f,
        other => panic!("expected to go, got {other:?}"),
    }
}
