//! One worker's streams, from request headers to the stream's end, sans-IO: the host turns its
//! callbacks into calls here and applies the `Reaction` each returns (effects, then continue or
//! pause). What a stream waits for, when the wait is due and what happens then is decided
//! here, once, for every host; a host only supplies the mechanism of waking (`tick` when
//! `next_due_ms` says, however it keeps time).
//!
//! A stream's state (`Stream`) lives in the worker's map from its first callback until its end;
//! a stream that is not in the map is done (answered locally, or never governed).

use crate::classify;
use crate::config::OnError;
use crate::deadline;
pub use crate::effects::{Action, Effect, Failure, Lent, NoBodies, Reaction, StreamIo};
use crate::env::{Clock, Env};
use crate::estimate;
use crate::fleet::{
    first_stage, refusal_wait_ms, Ask, FleetCharge, Said, ServiceCall, ServiceReply,
};
use crate::headers::Headers;
use crate::hold::{Holds, Outcome};
use crate::lease::Leases;
use crate::metrics::{Counter, GaugeCache, Histogram};
use crate::policy::{Blocked, Flow, Governor, RequestView, ResponseStep};
use crate::reply::{self, HELD_MS_HEADER, STEERING_HEADER};
use crate::retry_after::{Random, Xorshift};
use crate::stream::{BodyCapability, BodyRead, FleetWait, Stream, Streams};
pub use crate::stream::{
    Stage, BODY_WAIT_MS, HEADERS_ONLY_FOR_MS, MAX_ERROR_BODY, REQUEST_BODY_WAIT_MS,
};
use crate::usage::UsageScanner;
use std::collections::BTreeSet;
use std::sync::Arc;

/// One worker's state: its streams, holds, waits' deadlines, leases, randomness and gauge cache.
/// The `Governor` (configuration) is shared by every worker.
pub struct Worker {
    gov: Arc<Governor>,
    streams: Streams,
    holds: Holds,
    /// (until, stream id) of every stream that waits on time.
    due: BTreeSet<(u64, u32)>,
    body: BodyCapability,
    leases: Leases,
    rng: Box<dyn Random + Send>,
    gauges: GaugeCache,
    /// The next call's sequence number.
    next_seq: u32,
    /// Calls owed to the fleet's service that belong to no stream (commits at a stream's
    /// end, releases of reservations not used): the host sends them from its timer
    /// (`take_owed`), where a call outlives the stream that owed it.
    owed: Vec<ServiceCall>,
}

/// Borrow a worker's parts for one call: `$g` the governor, `$holds` its holds, `$env` the
/// environment over what the host lent (its stats behind the worker's gauge cache).
macro_rules! borrow_env {
    ($self:ident, $lent:ident, $clock:expr => $g:ident, $holds:ident, $env:ident) => {
        let Worker {
            gov,
            holds: $holds,
            leases,
            rng,
            gauges,
            ..
        } = $self;
        let $g: &Governor = gov;
        let mut metrics = gauges.over(&mut *$lent.metrics);
        #[allow(unused_mut)]
        let mut $env = Env {
            store: $lent.store,
            metrics: &mut metrics,
            rng: &mut **rng,
            leases,
            clock: $clock,
        };
    };
}

impl Worker {
    /// A worker over `gov`, its randomness seeded with `seed` (the host's entropy).
    pub fn new(gov: Arc<Governor>, seed: u64) -> Worker {
        Worker::with_random(gov, Box::new(Xorshift::seeded(seed)))
    }

    /// A worker that draws its jitter from `rng` (tests fix it).
    pub fn with_random(gov: Arc<Governor>, rng: Box<dyn Random + Send>) -> Worker {
        Worker {
            gov,
            streams: Streams::default(),
            holds: Holds::new(),
            due: BTreeSet::new(),
            body: BodyCapability::default(),
            leases: Leases::default(),
            rng,
            gauges: GaugeCache::default(),
            next_seq: 1,
            owed: Vec::new(),
        }
    }

    pub fn governor(&self) -> &Governor {
        &self.gov
    }

    /// This worker's leases of request tokens.
    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// Requests held now on this worker.
    pub fn held(&self) -> usize {
        self.holds.len()
    }

    /// The flow of a stream that went upstream (or whose error body is awaited).
    pub fn flow(&self, id: u32) -> Option<&Flow> {
        match self.streams.get(&id)? {
            Stream::Upstream { flow, .. } | Stream::AwaitingErrorBody { flow, .. } => Some(flow),
            _ => None,
        }
    }

    pub fn stage(&self, id: u32) -> Stage {
        match self.streams.get(&id) {
            Some(Stream::ReadingBody(_)) => Stage::ReadingBody,
            Some(Stream::Held { .. }) => Stage::Held,
            Some(Stream::ReplyPending { .. }) => Stage::ReplyPending,
            Some(Stream::Upstream { .. }) => Stage::Upstream,
            Some(Stream::AwaitingErrorBody { .. }) => Stage::AwaitingErrorBody,
            Some(Stream::AwaitingFleet(_)) => Stage::AwaitingFleet,
            None => Stage::Done,
        }
    }

    /// Whether `on_response_headers` needs stream `id`'s response headers (it went upstream
    /// governed): a host may skip reading the map for any other.
    pub fn reads_response_headers(&self, id: u32) -> bool {
        matches!(self.streams.get(&id), Some(Stream::Upstream { .. }))
    }

    /// Whether `on_request_body` (`request`) or `on_response_body` would do anything for
    /// stream `id` now: a host may let any other body chunk through without reading its size.
    pub fn reads_body(&self, id: u32, request: bool) -> bool {
        match self.streams.get(&id) {
            Some(
                Stream::ReadingBody(_)
                | Stream::Held { .. }
                | Stream::AwaitingFleet(_)
                | Stream::ReplyPending { .. },
            ) => request,
            Some(Stream::Upstream { usage, .. }) => !request && usage.is_some(),
            Some(Stream::AwaitingErrorBody { .. }) => !request,
            _ => false,
        }
    }

    /// When `tick` next has something to do; None when nothing waits or is held.
    pub fn next_due_ms(&self) -> Option<u64> {
        let wait = self.due.first().map(|(until, _)| *until);
        match (wait, self.holds.next_due_ms()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Nothing waits, nothing is held and no call is owed: no tick is needed.
    pub fn is_idle(&self) -> bool {
        self.due.is_empty() && self.holds.is_empty() && self.owed.is_empty()
    }

    /// The calls owed to the fleet's service that belong to no stream, for the host to send
    /// from its timer (the root context: they outlive the stream) and to answer with
    /// `on_service_answer(None, …)`.
    pub fn take_owed(&mut self) -> Vec<ServiceCall> {
        std::mem::take(&mut self.owed)
    }

    /// What became of the call `seq` (of stream `stream`, or owed by none): the fleet's
    /// answer decides the request once every call of its admission is in.
    pub fn on_service_answer(
        &mut self,
        stream: Option<u32>,
        seq: u32,
        reply: ServiceReply,
        lent: &mut Lent,
    ) -> Reaction {
        let Some(id) = stream else {
            // A commit or a release: only counted.
            let c = match reply {
                ServiceReply::Message(_) => Counter::FleetCallsOk,
                ServiceReply::Failed(_) => Counter::FleetErrors,
            };
            lent.metrics.count(self.gov.cfg.pools.len() - 1, c);
            return Reaction::none();
        };
        let Some(Stream::AwaitingFleet(w)) = self.streams.get_mut(&id) else {
            return Reaction::none(); // late: the stream went on without it
        };
        let at = seq.wrapping_sub(w.first_seq) as usize;
        if at >= w.sent || w.said[at].is_some() {
            return Reaction::none();
        }
        let said = self.gov.said(&w.asks[at], reply);
        let pool = w.flow.pool;
        let elapsed = (lent.clock)().saturating_sub(w.sent_ms);
        lent.metrics
            .histogram(pool, Histogram::FleetCallMs, elapsed);
        lent.metrics.count(
            pool,
            match said {
                Said::Ok { .. } => Counter::FleetCallsOk,
                Said::Over { .. } => Counter::FleetCallsOverLimit,
                Said::Failed => Counter::FleetErrors,
            },
        );
        w.said[at] = Some(said);
        let stage = &w.said[..w.sent];
        if !stage.iter().all(Option::is_some) {
            return Reaction::none();
        }
        if w.sent < w.asks.len() && !stage.iter().any(|s| matches!(s, Some(Said::Over { .. }))) {
            return self.ask_rest(id, lent);
        }
        self.fleet_decided(id, lent)
    }

    /// The request headers arrived (`end_of_stream`: the request has no body).
    pub fn on_request_headers(
        &mut self,
        id: u32,
        view: &RequestView,
        end_of_stream: bool,
        lent: &mut Lent,
    ) -> Reaction {
        let mut effects = Vec::new();
        if view.headers.contains(STEERING_HEADER) {
            // Nothing reads it (config refuses it as any header the policy reads); removing it
            // keeps the client from choosing the route, and with it the credential.
            effects.push(Effect::StripSteeringHeader);
        }
        // A request nothing is cooling or limiting by time is decided without the clock.
        let clock = Clock::lazy(lent.clock);
        let g = &*self.gov;
        let flow = g.flow_for(view);
        let budget_ms = deadline::hold_budget_ms(&g.cfg.hold, &view.headers);
        if g.reads_body() && !end_of_stream && self.body.expected(|| clock.now()) {
            // A limit reserves tokens (or keys by model): admission waits for the body.
            let content_length = view
                .headers
                .get_str("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let read = BodyRead {
                flow,
                budget_ms,
                content_length,
                until_ms: clock.now() + BODY_WAIT_MS,
                seen: false,
            };
            self.set(id, Stream::ReadingBody(read));
            return Reaction::new(effects, Action::Pause);
        }
        let at = BodyAt {
            done: end_of_stream,
            buffered: 0,
            from_tick: false,
            budget_ms,
        };
        let mut r = self.admit(id, flow, budget_ms, at, clock, lent);
        effects.append(&mut r.effects);
        r.effects = effects;
        r
    }

    /// A part of the request body arrived; `body_size` is what Envoy buffers for the filter.
    pub fn on_request_body(
        &mut self,
        id: u32,
        body_size: usize,
        end_of_stream: bool,
        lent: &mut Lent,
    ) -> Reaction {
        match self.streams.get_mut(&id) {
            Some(Stream::ReadingBody(read)) => {
                if !read.seen {
                    // Some of it came: the rest gets the longer wait.
                    read.seen = true;
                    self.body.seen();
                    let until = (lent.clock)() + REQUEST_BODY_WAIT_MS;
                    let old = std::mem::replace(&mut read.until_ms, until);
                    self.due.remove(&(old, id));
                    self.due.insert((until, id));
                }
                if !end_of_stream && body_size < estimate::MAX_BODY {
                    return Reaction::new(Vec::new(), Action::Pause); // Envoy buffers it
                }
                self.admit_read(id, Some(body_size), end_of_stream, lent)
            }
            Some(Stream::Held { body_ended })
            | Some(Stream::AwaitingFleet(FleetWait { body_ended, .. })) => {
                // Envoy buffers the body until the request is let go; continuing here would
                // release the held headers too.
                *body_ended |= end_of_stream;
                Reaction::new(Vec::new(), Action::Pause)
            }
            Some(Stream::ReplyPending { .. }) if end_of_stream => self.send_pending(id),
            Some(Stream::ReplyPending { .. }) => {
                let drop = (body_size > 0).then_some(Effect::DropRequestBody(body_size));
                Reaction::new(drop.into_iter().collect(), Action::Pause)
            }
            _ => Reaction::go_on(),
        }
    }

    /// The request trailers arrived: its body has ended.
    pub fn on_request_trailers(&mut self, id: u32, lent: &mut Lent) -> Reaction {
        match self.streams.get_mut(&id) {
            Some(Stream::ReadingBody(_)) => self.admit_read(id, None, true, lent),
            Some(Stream::Held { body_ended })
            | Some(Stream::AwaitingFleet(FleetWait { body_ended, .. })) => {
                *body_ended = true;
                Reaction::new(Vec::new(), Action::Pause)
            }
            Some(Stream::ReplyPending { .. }) => self.send_pending(id),
            _ => Reaction::go_on(),
        }
    }

    /// The response headers arrived.
    pub fn on_response_headers(
        &mut self,
        id: u32,
        headers: &Headers,
        end_of_stream: bool,
        lent: &mut Lent,
    ) -> Reaction {
        let Some(Stream::Upstream { flow, usage }) = self.streams.get_mut(&id) else {
            return Reaction::go_on();
        };
        let mut effects = Vec::new();
        // What the client and the access log learn about a steered or held request.
        let steered = self
            .gov
            .steered_to(flow)
            .map(|n| (STEERING_HEADER, n.to_string()));
        let held = flow.held_ms.map(|ms| (HELD_MS_HEADER, ms.to_string()));
        let told: Vec<(&'static str, String)> = steered.into_iter().chain(held).collect();
        if !told.is_empty() {
            set_headers(&mut effects, told);
        }
        let status = headers
            .get_str(":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        let charged = !flow.charges.is_empty() || flow.fleet_charged();
        let scan_usage = charged && (200..300).contains(&status) && !end_of_stream;
        let governed = classify::is_governed_status(status);
        // An error the provider sent used no tokens: its reservations are given back. Envoy's
        // own errors (a reset, a timeout) say nothing of what the provider did: kept.
        let refund = status >= 400 && flow.reserves();
        let upstream = !(governed || refund) || lent.io.answered_by_upstream(id);
        // A plain success needs no time (nothing cools, nothing waits): the clock is read only
        // when the policy asks, once.
        borrow_env!(self, lent, Clock::lazy(lent.clock) => g, _holds, env);
        if governed && !upstream {
            // Envoy's own 503 (upstream reset, connect failure, no healthy host) is not the
            // provider saying "not now": leave it ungoverned.
            g.on_envoy_response(flow, &mut env);
            return Reaction::new(effects, Action::Continue);
        }
        if refund && upstream {
            g.on_upstream_error(flow, &mut env);
        }
        let body_available = self.body.expected(|| env.now());
        let step = g.on_response_headers(
            flow,
            status,
            headers,
            end_of_stream,
            body_available,
            &mut env,
        );
        if scan_usage {
            *usage = Some(UsageScanner::new());
        }
        match step {
            ResponseStep::Rewrite(governed) => {
                set_headers(&mut effects, governed.headers);
                Reaction::new(effects, Action::Continue)
            }
            ResponseStep::NeedBody => {
                let until_ms = env.now() + BODY_WAIT_MS;
                if let Some(Stream::Upstream { flow, .. }) = self.streams.remove(&id) {
                    let wait = Stream::AwaitingErrorBody {
                        flow,
                        status,
                        headers: headers.to_wire(),
                        until_ms,
                        arrived: Vec::new(),
                    };
                    self.set(id, wait);
                }
                Reaction::new(effects, Action::Pause)
            }
            ResponseStep::Pass => Reaction::new(effects, Action::Continue),
        }
    }

    /// A part of the response body arrived; `body_size` is what Envoy buffers for the filter.
    pub fn on_response_body(
        &mut self,
        id: u32,
        body_size: usize,
        end_of_stream: bool,
        lent: &mut Lent,
    ) -> Reaction {
        match self.streams.get_mut(&id) {
            Some(Stream::Upstream {
                usage: Some(scanner),
                ..
            }) => {
                scanner.feed(&lent.io.response_body(id, body_size));
                Reaction::go_on()
            }
            Some(Stream::AwaitingErrorBody { arrived, .. })
                if !end_of_stream && body_size < MAX_ERROR_BODY =>
            {
                // Envoy buffers it; what arrived is kept, so a body that misses its wait is
                // still classified on what came.
                self.body.seen();
                if body_size > arrived.len() {
                    *arrived = lent.io.response_body(id, body_size.min(MAX_ERROR_BODY));
                }
                Reaction::new(Vec::new(), Action::Pause)
            }
            Some(Stream::AwaitingErrorBody { .. }) => {
                self.body.seen();
                self.classify_awaited(id, false, lent)
            }
            _ => Reaction::go_on(),
        }
    }

    /// The response trailers arrived.
    pub fn on_response_trailers(&mut self, id: u32, lent: &mut Lent) -> Reaction {
        match self.streams.get(&id) {
            Some(Stream::AwaitingErrorBody { .. }) => self.classify_awaited(id, false, lent),
            _ => Reaction::go_on(),
        }
    }

    /// The stream is over (complete, reset or cancelled): forget it if held, give back what it
    /// took, charge what the provider reported. A second call does nothing.
    pub fn on_end(&mut self, id: u32, lent: &mut Lent) {
        let Some(stream) = self.take_stream(id) else {
            return;
        };
        // Most streams owe nothing at their end: the clock is read only for those that do.
        borrow_env!(self, lent, Clock::lazy(lent.clock) => g, holds, env);
        let mut settled = Vec::new();
        match stream {
            Stream::Upstream { mut flow, usage } => {
                let usage = usage.and_then(|s| s.total());
                if flow.owes_at_end() || usage.is_some() {
                    g.on_stream_end(&mut flow, usage, &mut env);
                }
                settled = flow.fleet.map(|f| f.charges).unwrap_or_default();
            }
            Stream::AwaitingErrorBody { mut flow, .. } => {
                if flow.owes_at_end() {
                    g.on_stream_end(&mut flow, None, &mut env);
                }
                settled = flow.fleet.map(|f| f.charges).unwrap_or_default();
            }
            Stream::Held { .. } => {
                holds.forget(id, &mut env);
            }
            Stream::AwaitingFleet(w) => {
                // Gone before the fleet answered: what it took locally goes back, and what
                // the fleet reserved for it so far is released.
                let FleetWait {
                    mut flow,
                    asks,
                    said,
                    ..
                } = w;
                g.limits().undo(&mut flow, &mut env);
                g.give_back_release(&mut flow, &mut env);
                for (limit, key, r) in granted(asks, said) {
                    let seq = next(&mut self.next_seq);
                    self.owed.push(g.release_call(limit, key, &r, seq));
                }
            }
            Stream::ReadingBody(_) | Stream::ReplyPending { .. } => {}
        }
        for charge in settled {
            let seq = next(&mut self.next_seq);
            if let Some(call) = g.settle_call(&charge, seq) {
                self.owed.push(call);
            }
        }
    }

    /// The host could not apply an effect for stream `id`: what to do instead.
    pub fn failed(&mut self, id: u32, failure: Failure, lent: &mut Lent) -> Reaction {
        match failure {
            // Fail open: the request goes on ungoverned rather than hang.
            Failure::Reply => Reaction::go_on(),
            // Refuse: whatever it took is given back when the stream ends.
            Failure::Strip => Reaction::new(
                vec![Effect::SendReply(reply::reserved_header())],
                Action::Pause,
            ),
            // The stream is gone: give back what it took now.
            Failure::Resume => {
                self.on_end(id, lent);
                Reaction::new(Vec::new(), Action::Pause)
            }
            // A call that could not be sent is a call that failed: the fallback decides.
            Failure::Call(seq) => {
                self.on_service_answer(Some(id), seq, ServiceReply::Failed(0), lent)
            }
        }
    }

    /// Waits whose deadline passed go on with their own consequence, and held requests whose
    /// gates opened (or whose wait outgrew their limit) leave. Returns what the host must do
    /// for each stream, in order.
    pub fn tick(&mut self, lent: &mut Lent) -> Vec<(u32, Reaction)> {
        let now = (lent.clock)();
        let mut out = Vec::new();
        while let Some(&(until, id)) = self.due.first() {
            if until > now {
                break;
            }
            self.due.pop_first();
            let reaction = match self.streams.get(&id) {
                Some(Stream::AwaitingErrorBody { .. }) => {
                    let mut r = self.classify_awaited(id, true, lent);
                    r.effects.push(Effect::ResumeResponse);
                    r.action = Action::Pause;
                    r
                }
                Some(Stream::ReplyPending { .. }) => self.send_pending(id),
                // The service never answered within its timeout: the unanswered calls failed.
                Some(Stream::AwaitingFleet(w)) => {
                    let sent = &w.said[..w.sent];
                    let (pool, n) = (w.flow.pool, sent.iter().filter(|s| s.is_none()).count());
                    for _ in 0..n {
                        lent.metrics.count(pool, Counter::FleetErrors);
                    }
                    // `fleet_decided` reads an unanswered call as failed.
                    self.fleet_decided(id, lent)
                }
                Some(Stream::ReadingBody(read)) => {
                    // The body is slow, or body callbacks never come: admit on what arrived.
                    if !read.seen && !self.body.proven {
                        let pool = read.flow.pool;
                        self.body_never_came(pool, now, lent);
                    }
                    self.admit_read(id, None, false, lent)
                }
                _ => continue,
            };
            out.push((id, reaction));
        }
        if !self.holds.is_empty() {
            borrow_env!(self, lent, Clock::At(now) => g, holds, env);
            let left = holds.tick(g, &mut env);
            for (id, outcome) in left {
                let body_ended = match self.take_stream(id) {
                    Some(Stream::Held { body_ended }) => body_ended,
                    _ => false,
                };
                let budget_ms = match &outcome {
                    Outcome::Go(flow) => flow.hold_deadline_ms.map_or(0, |d| d.saturating_sub(now)),
                    _ => 0,
                };
                let at = BodyAt {
                    done: body_ended,
                    buffered: 0,
                    from_tick: true,
                    budget_ms,
                };
                out.push((id, self.take(id, outcome, at, &Clock::At(now))));
            }
        }
        out
    }

    /// Put stream `id` in `state`, keeping the waits' deadlines in step.
    fn set(&mut self, id: u32, state: Stream) {
        if let Some(until) = state.until_ms() {
            self.due.insert((until, id));
        }
        if let Some(old) = self.streams.insert(id, state) {
            if let Some(until) = old.until_ms() {
                self.due.remove(&(until, id));
            }
        }
    }

    /// Take stream `id` out of the map (it is done unless put back).
    fn take_stream(&mut self, id: u32) -> Option<Stream> {
        let stream = self.streams.remove(&id)?;
        if let Some(until) = stream.until_ms() {
            self.due.remove(&(until, id));
        }
        Some(stream)
    }

    /// Admission for a request whose flow is built (and estimated, when its body was read):
    /// the hold state machine decides, `take` carries it out. `clock` is this call's, so the
    /// time is read at most once.
    fn admit(
        &mut self,
        id: u32,
        flow: Flow,
        budget_ms: u64,
        at: BodyAt,
        clock: Clock,
        lent: &mut Lent,
    ) -> Reaction {
        borrow_env!(self, lent, clock => g, holds, env);
        let outcome = holds.request(g, flow, budget_ms, id, &mut env);
        let clock = env.clock.known().map_or(Clock::lazy(lent.clock), Clock::At);
        self.take(id, outcome, at, &clock)
    }

    /// Do what admission decided: let it go, hold it, or answer it (once its body has ended,
    /// so an HTTP/1.1 connection survives the answer).
    fn take(&mut self, id: u32, outcome: Outcome, at: BodyAt, clock: &Clock) -> Reaction {
        let BodyAt {
            done: body_done,
            buffered,
            from_tick,
            budget_ms,
        } = at;
        let mut effects = Vec::new();
        match outcome {
            Outcome::Go(flow) if !self.gov.fleet_limits().is_empty() => {
                self.ask_fleet(id, flow, body_done, budget_ms, clock)
            }
            Outcome::Go(flow) => self.let_go(id, flow, from_tick),
            Outcome::Held => {
                self.set(
                    id,
                    Stream::Held {
                        body_ended: body_done,
                    },
                );
                Reaction::new(effects, Action::Pause)
            }
            Outcome::Reply(_, reply) => {
                effects.push(Effect::AccessLog(reply::access_log(&reply.headers)));
                if body_done || !self.body.expected(|| clock.now()) {
                    self.take_stream(id);
                    effects.push(Effect::SendReply(reply));
                } else {
                    if buffered > 0 {
                        effects.push(Effect::DropRequestBody(buffered));
                    }
                    let until_ms = clock.now() + REQUEST_BODY_WAIT_MS;
                    self.set(id, Stream::ReplyPending { reply, until_ms });
                }
                Reaction::new(effects, Action::Pause)
            }
        }
    }

    /// Forward a request admitted (locally, and by the fleet when it has fleet limits).
    fn let_go(&mut self, id: u32, flow: Flow, from_tick: bool) -> Reaction {
        let mut effects = Vec::new();
        if let Some(name) = self.gov.steered_to(&flow) {
            effects.push(Effect::Steer(name.to_string()));
        }
        self.set(id, Stream::Upstream { flow, usage: None });
        if from_tick {
            effects.push(Effect::ResumeRequest);
            return Reaction::new(effects, Action::Pause);
        }
        Reaction::new(effects, Action::Continue)
    }

    /// Admitted locally: ask the fleet's service for every fleet limit (the reservations
    /// first when there are other asks, `fleet::first_stage`) and wait.
    #[inline(never)]
    fn ask_fleet(
        &mut self,
        id: u32,
        flow: Flow,
        body_ended: bool,
        budget_ms: u64,
        clock: &Clock,
    ) -> Reaction {
        let asks = self.gov.fleet_asks(&flow);
        // Every ask's seq now: an answer's seq says which ask it is, whichever stage sent it.
        let first_seq = self.next_seq;
        for _ in &asks {
            next(&mut self.next_seq);
        }
        let end = first_stage(&asks);
        let wait = FleetWait {
            flow,
            budget_ms,
            body_ended,
            sent_ms: 0,
            until_ms: 0,
            first_seq,
            sent: 0,
            said: vec![None; asks.len()],
            asks,
        };
        self.send_asks(id, wait, end, clock.now())
    }

    /// Every reservation of the first stage was granted (or failed: the fallback decides it):
    /// ask the rest.
    fn ask_rest(&mut self, id: u32, lent: &mut Lent) -> Reaction {
        let Some(Stream::AwaitingFleet(wait)) = self.take_stream(id) else {
            return Reaction::none();
        };
        let end = wait.asks.len();
        self.send_asks(id, wait, end, (lent.clock)())
    }

    /// Send the asks of `wait` from the first not sent up to `end`, and wait for them until
    /// the service's timeout (and the slack for an answer Envoy never delivers).
    fn send_asks(&mut self, id: u32, mut wait: FleetWait, end: usize, now: u64) -> Reaction {
        let effects = (wait.sent..end)
            .map(|i| {
                let seq = wait.first_seq.wrapping_add(i as u32);
                Effect::CallService(self.gov.ask_call(&wait.asks[i], seq))
            })
            .collect();
        let timeout = self.gov.cfg.fleet.as_ref().map_or(0, |f| f.timeout_ms);
        wait.sent = end;
        wait.sent_ms = now;
        wait.until_ms = now + timeout + crate::fleet::ANSWER_SLACK_MS;
        self.set(id, Stream::AwaitingFleet(wait));
        Reaction::new(effects, Action::Pause)
    }

    /// Every call of a request's admission is in (or overdue): go, or be held or answered as
    /// the fleet (or, for calls that failed, `fleet.on_error`) says.
    #[inline(never)]
    fn fleet_decided(&mut self, id: u32, lent: &mut Lent) -> Reaction {
        let Some(Stream::AwaitingFleet(w)) = self.take_stream(id) else {
            return Reaction::none();
        };
        let FleetWait {
            mut flow,
            budget_ms,
            body_ended,
            asks,
            said,
            ..
        } = w;
        let said: Vec<Said> = said
            .into_iter()
            .map(|s| s.unwrap_or(Said::Failed))
            .collect();
        let on_error = self
            .gov
            .cfg
            .fleet
            .as_ref()
            .map_or(OnError::Local, |f| f.on_error);
        let default_ms = self.gov.cfg.retry_after.default_ms;
        let mut owed = Vec::new();
        let mut now = None;
        let outcome = {
            borrow_env!(self, lent, Clock::lazy(lent.clock) => g, holds, env);
            let over = asks.iter().zip(&said).find_map(|(a, s)| match s {
                Said::Over { wait_ms } => Some((a.limit, *wait_ms)),
                _ => None,
            });
            let failed: Vec<usize> = asks
                .iter()
                .zip(&said)
                .filter(|(_, s)| matches!(s, Said::Failed))
                .map(|(a, _)| a.limit)
                .collect();
            let mut refused = None;
            let mut deny = false;
            if let Some((limit, wait_ms)) = over {
                refused = Some(Blocked::Bucket {
                    limit,
                    wait_ms: refusal_wait_ms(wait_ms, default_ms, env.rng),
                    remaining: 0,
                });
            } else if !failed.is_empty() {
                env.metrics.count(flow.pool, Counter::FleetFallback);
                match on_error {
                    OnError::Allow => {}
                    OnError::Deny => {
                        deny = true;
                        refused = Some(Blocked::Bucket {
                            limit: failed[0],
                            wait_ms: default_ms,
                            remaining: 0,
                        });
                    }
                    OnError::Local => {
                        refused = g.limits().take_fallback(&mut flow, &failed, &mut env).err();
                    }
                }
            }
            match refused {
                None => {
                    for (a, s) in asks.into_iter().zip(said) {
                        let Said::Ok { reservation } = s else {
                            continue;
                        };
                        if g.cfg.limits[a.limit].kind == crate::config::LimitKind::Tokens {
                            flow.fleet_mut().charges.push(FleetCharge {
                                limit: a.limit,
                                key: a.key,
                                amount: a.amount,
                                reservation,
                                settled: None,
                            });
                        }
                    }
                    Outcome::Go(flow)
                }
                Some(blocked) => {
                    // What the request holds goes back: the local takes, the pace's release,
                    // the fleet's reservations (released at no cost).
                    owed.extend(granted(asks, said));
                    g.limits().undo(&mut flow, &mut env);
                    g.give_back_release(&mut flow, &mut env);
                    now = Some(env.now());
                    if deny {
                        let reply = g.reply_for(&flow, &blocked, &mut env);
                        Outcome::Reply(flow, reply)
                    } else {
                        holds.refused(g, flow, blocked, budget_ms, id, &mut env)
                    }
                }
            }
        };
        for (limit, key, r) in owed {
            let seq = next(&mut self.next_seq);
            let call = self.gov.release_call(limit, key, &r, seq);
            self.owed.push(call);
        }
        if let Outcome::Go(flow) = outcome {
            return self.let_go(id, flow, true);
        }
        let at = BodyAt {
            done: body_ended,
            buffered: 0,
            from_tick: true,
            budget_ms,
        };
        let clock = now.map_or(Clock::lazy(lent.clock), Clock::At);
        self.take(id, outcome, at, &clock)
    }

    /// Admit a request whose body was read: estimate it from the first `estimate::MAX_BODY`
    /// bytes Envoy buffered (`body_size` in all so far, when a body callback said; else what
    /// the buffer holds), then decide as for any request.
    fn admit_read(
        &mut self,
        id: u32,
        body_size: Option<usize>,
        body_done: bool,
        lent: &mut Lent,
    ) -> Reaction {
        let Some(Stream::ReadingBody(read)) = self.take_stream(id) else {
            return Reaction::go_on();
        };
        let bound = body_size
            .unwrap_or(estimate::MAX_BODY)
            .min(estimate::MAX_BODY);
        let prefix = lent.io.request_body(id, bound);
        let total = body_size.unwrap_or(prefix.len()).max(read.content_length);
        let BodyRead {
            mut flow,
            budget_ms,
            ..
        } = read;
        self.gov.on_request_body(&mut flow, &prefix, total);
        let at = BodyAt {
            done: body_done,
            buffered: body_size.unwrap_or(0),
            from_tick: body_size.is_none() && !body_done,
            budget_ms,
        };
        self.admit(id, flow, budget_ms, at, Clock::lazy(lent.clock), lent)
    }

    /// The request body ended (or its wait is over): send the answer that waited for it.
    fn send_pending(&mut self, id: u32) -> Reaction {
        match self.take_stream(id) {
            Some(Stream::ReplyPending { reply, .. }) => {
                Reaction::new(vec![Effect::SendReply(reply)], Action::Pause)
            }
            Some(other) => {
                self.set(id, other);
                Reaction::go_on()
            }
            None => Reaction::go_on(),
        }
    }

    /// Classify an awaited error response from its buffered body (overdue: whatever arrived)
    /// and let it go upstream's way with its governed headers.
    fn classify_awaited(&mut self, id: u32, overdue: bool, lent: &mut Lent) -> Reaction {
        let Some(Stream::AwaitingErrorBody {
            mut flow,
            status,
            headers,
            arrived,
            ..
        }) = self.take_stream(id)
        else {
            return Reaction::go_on();
        };
        let mut body = lent.io.response_body(id, MAX_ERROR_BODY);
        if body.len() < arrived.len() {
            body = arrived;
        }
        body.truncate(MAX_ERROR_BODY);
        let clock = Clock::lazy(lent.clock);
        if overdue && body.is_empty() && !self.body.proven {
            self.body_never_came(flow.pool, clock.now(), lent);
        }
        borrow_env!(self, lent, clock => g, _holds, env);
        let governed =
            g.on_response_body(&mut flow, status, &Headers::wire(&headers), &body, &mut env);
        self.set(id, Stream::Upstream { flow, usage: None });
        let mut effects = Vec::new();
        if let Some(g) = governed {
            set_headers(&mut effects, g.headers);
        }
        Reaction::new(effects, Action::Continue)
    }

    fn body_never_came(&mut self, pool: usize, now: u64, lent: &mut Lent) {
        self.body.headers_only_until = now + HEADERS_ONLY_FOR_MS;
        lent.metrics.count(pool, Counter::BodyUnavailable);
        if !std::mem::replace(&mut self.body.warned, true) {
            log::warn!(
                "llm_governor: a held body never arrived; for a minute, errors are classified from \
                 status and headers alone and token limits charge after the response instead of \
                 reserving. Set allow_on_headers_stop_iteration: true in the wasm plugin config so \
                 quota errors can be told from rate limits and requests can be estimated"
            );
        }
    }
}

/// Where a request stands when admission decides it: its body ended, how much of it Envoy
/// holds for the filter now, whether the request is paused by a tick (it must be resumed to
/// go), and how long it may still be held.
#[derive(Clone, Copy)]
struct BodyAt {
    done: bool,
    buffered: usize,
    from_tick: bool,
    budget_ms: u64,
}

/// A sequence number for the next call.
fn next(seq: &mut u32) -> u32 {
    let n = *seq;
    *seq = seq.wrapping_add(1).max(1);
    n
}

/// Set `headers` on the response and record what the access log reads of them.
fn set_headers(effects: &mut Vec<Effect>, headers: Vec<(&'static str, String)>) {
    effects.push(Effect::AccessLog(reply::access_log(&headers)));
    effects.push(Effect::SetResponseHeaders(headers));
}

/// The reservations the fleet granted a request's admission (an answer still missing counts
/// as none): released when the request does not go on.
fn granted<S: Into<Option<Said>>>(
    asks: Vec<Ask>,
    said: impl IntoIterator<Item = S>,
) -> impl Iterator<Item = (usize, String, String)> {
    asks.into_iter()
        .zip(said)
        .filter_map(|(a, s)| match s.into() {
            Some(Said::Ok {
                reservation: Some(r),
            }) => Some((a.limit, a.key, r)),
            _ => None,
        })
}
