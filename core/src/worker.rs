//! One worker's streams, from request headers to the stream's end, sans-IO: the host turns its
//! callbacks into calls here and applies each `Reaction` (`protocol` is how, for every host).
//! What a stream waits for, when the wait is due and what then happens is decided here; a host
//! only supplies the waking (`tick` when `next_due_ms` says, however it keeps time).
//! The Worker sequences; it decides nothing a job's own type decides (`hold`, `fleet::ask`,
//! `fleet::handoff`, `response`, `reply`); a stream's state lives in `stream` until its end.

use crate::blocked::Blocked;
use crate::effects;
pub use crate::effects::{Action, Direction, Effect, Failure, Lent, NoBodies, Reaction, StreamIo};
use crate::env::{Clock, Env};
use crate::estimate;
use crate::fleet::ask::{Admitted, FleetAsk, Progress, Verdict};
use crate::fleet::calls::{Calls, Done, SlotCall};
use crate::fleet::grpc::{ServiceReply, NOT_SENT};
use crate::fleet::side::FleetSide;
use crate::fleet::slots;
use crate::fleet::turn::{self, TurnKey};
use crate::headers::Headers;
use crate::hold::{Holds, Outcome};
use crate::lease::Leases;
use crate::metrics::GaugeCache;
use crate::policy::Governor;
use crate::reply;
use crate::request::{Flow, RequestView, STEERING_HEADER};
use crate::response::ResponseStep;
use crate::retry_after::{Random, Xorshift};
use crate::store::SharedStore;
use crate::stream::{self, At, BodyCapability, BodyRead, Stream, Streams};
pub use crate::stream::{
    Stage, BODY_WAIT_MS, HEADERS_ONLY_FOR_MS, MAX_ERROR_BODY, REQUEST_BODY_WAIT_MS,
};
use crate::usage::UsageScanner;
use std::sync::Arc;

/// One worker's state: its streams, holds, leases, randomness, gauge cache and calls to the
/// fleet's service. The `Governor` (configuration) is shared by every worker.
pub struct Worker {
    gov: Arc<Governor>,
    streams: Streams,
    holds: Holds,
    body: BodyCapability,
    leases: Leases,
    rng: Box<dyn Random + Send>,
    gauges: GaugeCache,
    /// Its calls to the fleet's service, turns and watch (`fleet::side`).
    fleet: FleetSide,
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
    pub fn with_random(gov: Arc<Governor>, mut rng: Box<dyn Random + Send>) -> Worker {
        Worker {
            fleet: FleetSide::new(&gov),
            gov,
            streams: Streams::default(),
            holds: Holds::new(rng.unit().to_bits()),
            body: BodyCapability::default(),
            leases: Leases::default(),
            rng,
            gauges: GaugeCache::default(),
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
        self.streams.flow(id)
    }

    pub fn stage(&self, id: u32) -> Stage {
        self.streams.stage(id)
    }

    /// Whether `on_response_headers` needs stream `id`'s response headers (it went upstream
    /// governed): a host may skip reading the map for any other.
    pub fn reads_response_headers(&self, id: u32) -> bool {
        matches!(self.streams.get(id), Some(Stream::Upstream { .. }))
    }

    /// Whether a body callback of this direction would do anything for stream `id` now: a host
    /// may let any other body chunk through without reading its size.
    pub fn reads_body(&self, id: u32, direction: Direction) -> bool {
        self.streams.reads_body(id, direction)
    }

    /// When `tick` next has something to do; None when nothing waits or is held.
    pub fn next_due_ms(&self) -> Option<u64> {
        let due = [
            self.streams.next_due_ms(),
            self.holds.next_due_ms(),
            self.fleet.next_check_ms(),
        ];
        due.into_iter().flatten().min()
    }

    /// How often a host should tick (`FleetSide::tick_ms`); None: no tick is needed.
    pub fn tick_ms(&self) -> Option<u64> {
        let busy = self.streams.waits() || !self.holds.is_empty();
        self.fleet.tick_ms(busy)
    }

    /// The worker's calls to the fleet's service: the owed ones for the host to send from
    /// its timer (they outlive the stream that owed them), and what the host sent.
    pub fn calls(&mut self) -> &mut Calls {
        &mut self.fleet.calls
    }

    /// What became of the call `token` of `stream` (None: owed by no stream). For a stream
    /// whose admission waited for it: that stream's reaction, to apply outside its callbacks.
    pub fn on_call_done(
        &mut self,
        stream: Option<u32>,
        token: u64,
        reply: ServiceReply,
        lent: &mut Lent,
    ) -> Option<(u32, Reaction)> {
        match self.fleet.calls.done(stream, token, reply, lent.metrics)? {
            Done::Stream { id, seq } => Some((id, self.fleet_step(id, Some((seq, reply)), lent))),
            Done::Slot { call, key } => {
                self.slot_answered((call, key), reply, lent);
                None
            }
            done => {
                borrow_env!(self, lent, Clock::lazy(lent.clock) => g, _holds, env);
                self.fleet.answered(done, reply, g, &mut env);
                None
            }
        }
    }

    /// The host could not send the owed call `seq`: a failed call (a slot's renewal goes on).
    pub fn call_not_sent(&mut self, seq: u32, lent: &mut Lent) {
        if let Some(Done::Slot { call, key }) = self.fleet.not_sent(seq, lent.metrics) {
            self.slot_answered((call, key), ServiceReply::Failed(NOT_SENT), lent);
        }
    }

    /// A step of a fleet slot's renewal was answered (`fleet::slots`).
    fn slot_answered(&mut self, of: (SlotCall, String), reply: ServiceReply, lent: &mut Lent) {
        let (gov, calls, now) = (&self.gov, &mut self.fleet.calls, (lent.clock)());
        slots::reply(gov, calls, &mut self.streams, lent.metrics, of, reply, now);
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
        let mut flow = g.pools().flow_for(view);
        if g.reads_body() && !end_of_stream && self.body.expected(|| clock.now()) {
            // A limit reserves tokens (or keys by model): admission waits for the body.
            flow.hold.fix(|| clock.now()); // the stream leaves its arrival callback
            let (length, until_ms) = (view.headers.content_length(), clock.now() + BODY_WAIT_MS);
            let read = BodyRead::new(flow, length, until_ms);
            self.streams.set(id, Stream::ReadingBody(read));
            return Reaction::new(effects, Action::Pause);
        }
        let mut r = self.admit(id, flow, At::arrived(end_of_stream), clock, lent);
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
        self.request_body(id, Some(body_size), end_of_stream, lent)
    }

    /// The request trailers arrived: its body has ended.
    pub fn on_request_trailers(&mut self, id: u32, lent: &mut Lent) -> Reaction {
        self.request_body(id, None, true, lent)
    }

    /// Some of the request body (`size` buffered in all, when a body callback said), or its
    /// end.
    fn request_body(
        &mut self,
        id: u32,
        size: Option<usize>,
        ended: bool,
        lent: &mut Lent,
    ) -> Reaction {
        match self.streams.get_mut(id) {
            Some(Stream::ReadingBody(read)) => {
                if !read.seen && size.is_some() {
                    // Some of it came: the rest gets the longer wait.
                    read.seen = true;
                    self.body.seen();
                    let until = (lent.clock)() + REQUEST_BODY_WAIT_MS;
                    self.streams.read_longer(id, until);
                }
                if !ended && size.is_some_and(|n| n < estimate::MAX_BODY) {
                    return Reaction::pause(); // Envoy buffers it
                }
                self.admit_read(id, size, ended, lent)
            }
            Some(Stream::ReplyPending { .. }) => self.streams.pending_body(id, size, ended),
            Some(paused) => match paused.body_ended() {
                // Held or waiting for the fleet: Envoy buffers the body until the request is
                // let go; continuing here would release the held headers too.
                Some(body_ended) => {
                    *body_ended |= ended;
                    Reaction::pause()
                }
                None => Reaction::go_on(),
            },
            None => Reaction::go_on(),
        }
    }

    /// The response headers arrived: `response::Responses` decides what they mean.
    pub fn on_response_headers(
        &mut self,
        id: u32,
        headers: &Headers,
        end_of_stream: bool,
        lent: &mut Lent,
    ) -> Reaction {
        let Some(Stream::Upstream { flow, usage }) = self.streams.get_mut(id) else {
            return Reaction::go_on();
        };
        let key = TurnKey::of(flow);
        let status = headers.status();
        let io = &mut *lent.io;
        let mut from_upstream = || io.answered_by_upstream(id);
        // A plain success needs no time (nothing cools, nothing waits): the clock is read only
        // when the policy asks, once.
        borrow_env!(self, lent, Clock::lazy(lent.clock) => g, _holds, env);
        let responses = g.responses();
        let eos = end_of_stream;
        let decided =
            responses.on_headers(flow, status, headers, eos, &mut from_upstream, &mut env);
        let mut effects = Vec::new();
        if !decided.told.is_empty() {
            effects::set_headers(&mut effects, decided.told);
        }
        if decided.scan_usage {
            *usage = Some(UsageScanner::new());
        }
        let governed = match decided.step {
            ResponseStep::Pass => {
                if decided.cooled {
                    self.fleet.learned(&self.gov, key, lent.store, lent.clock);
                }
                return Reaction::new(effects, Action::Continue);
            }
            ResponseStep::Rewrite(governed) => Some(governed),
            ResponseStep::NeedBody if !self.body.expected(|| env.now()) => {
                // Body callbacks do not come now: classified by status and headers alone.
                responses.on_error_body(flow, status, headers, &[], &mut env)
            }
            ResponseStep::NeedBody => {
                let until_ms = env.now() + BODY_WAIT_MS;
                let wire = headers.to_wire();
                self.streams.await_error_body(id, status, wire, until_ms);
                return Reaction::new(effects, Action::Pause);
            }
        };
        if let Some(g) = governed {
            effects::set_headers(&mut effects, g.headers);
            self.fleet.learned(&self.gov, key, lent.store, lent.clock);
        }
        Reaction::new(effects, Action::Continue)
    }

    /// A part of the response body arrived; `body_size` is what Envoy buffers for the filter.
    pub fn on_response_body(
        &mut self,
        id: u32,
        body_size: usize,
        end_of_stream: bool,
        lent: &mut Lent,
    ) -> Reaction {
        match self.streams.get_mut(id) {
            Some(Stream::Upstream {
                usage: Some(scanner),
                ..
            }) if body_size > 0 => {
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
                Reaction::pause()
            }
            Some(Stream::AwaitingErrorBody { .. }) => {
                self.body.seen();
                self.classify_awaited(id, false, lent)
            }
            _ => Reaction::go_on(),
        }
    }

    /// The response trailers arrived: its body has ended.
    pub fn on_response_trailers(&mut self, id: u32, lent: &mut Lent) -> Reaction {
        self.on_response_body(id, 0, true, lent)
    }

    /// The stream is over (complete, reset or cancelled): forget it if held, give back what it
    /// took, charge what the provider reported, drop its calls still out; twice does nothing.
    pub fn on_end(&mut self, id: u32, lent: &mut Lent) {
        self.fleet
            .ended(id, &self.gov, &self.holds, lent.store, lent.clock);
        let Some(stream) = self.streams.take(id) else {
            return;
        };
        // Most streams owe nothing at their end: the clock is read only for those that do.
        let gov = self.gov.clone();
        borrow_env!(self, lent, Clock::lazy(lent.clock) => g, holds, env);
        let (mut flow, usage) = match stream {
            Stream::Upstream { flow, usage } => (flow, usage.and_then(|s| s.usage())),
            Stream::AwaitingErrorBody { flow, .. } => (flow, None),
            Stream::Held { .. } => return drop(holds.forget(g, id, &mut env)),
            Stream::AwaitingFleet { mut flow, ask, .. } => {
                // Gone before the fleet answered: what it took goes back, and what the fleet
                // reserved for it so far is released.
                g.admission().undo(&mut flow, &mut env);
                if let Some(fleet) = gov.fleet() {
                    let pool = flow.pool;
                    self.fleet
                        .calls
                        .owe_releases(fleet, &gov.cfg, pool, &ask.abandon());
                }
                return;
            }
            Stream::ReadingBody(_) | Stream::ReplyPending { .. } => return,
        };
        if !flow.owes_at_end() && usage.is_none() {
            return;
        }
        g.responses().on_stream_end(&mut flow, usage, &mut env);
        // The fleet's token budgets settle with the usage: a commit owed to the service.
        if let (Some(fleet), Some(charged)) = (gov.fleet(), &flow.fleet) {
            self.fleet
                .calls
                .owe_commits(fleet, &gov.cfg, flow.pool, &charged.charges);
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
                Reaction::pause()
            }
            // A call that could not be sent is a call that failed: the fallback decides.
            Failure::Call(seq) => {
                self.fleet_step(id, Some((seq, ServiceReply::Failed(NOT_SENT))), lent)
            }
        }
    }

    /// Waits whose deadline passed go on with their own consequence, and held requests whose
    /// gates opened (or whose wait outgrew their limit) leave. Returns what the host must do
    /// for each stream, in order.
    pub fn tick(&mut self, lent: &mut Lent) -> Vec<(u32, Reaction)> {
        let now = (lent.clock)();
        let mut out = Vec::new();
        while let Some(id) = self.streams.pop_due(now) {
            let reaction = match self.streams.get(id) {
                Some(Stream::AwaitingErrorBody { .. }) => {
                    let mut r = self.classify_awaited(id, true, lent);
                    r.effects.push(Effect::ResumeResponse);
                    r.action = Action::Pause;
                    r
                }
                Some(Stream::ReplyPending { .. }) => self.streams.pending_body(id, None, true),
                // The service never answered within its timeout: the calls still out failed.
                Some(Stream::AwaitingFleet { .. }) => self.fleet_step(id, None, lent),
                Some(Stream::Upstream { .. }) => {
                    slots::renew_due(&self.gov, &mut self.fleet.calls, &mut self.streams, id, now);
                    continue;
                }
                Some(Stream::ReadingBody(read)) => {
                    // The body is slow, or body callbacks never come: admit on what arrived.
                    if !read.seen && !self.body.proven {
                        self.body.missed(read.flow.pool, now, lent.metrics);
                    }
                    self.admit_read(id, None, false, lent)
                }
                _ => continue,
            };
            out.push((id, reaction));
        }
        self.fleet.tend(&self.gov, &self.holds, lent.store, now);
        if !self.holds.is_empty() {
            let left = {
                borrow_env!(self, lent, Clock::At(now) => g, holds, env);
                holds.tick(g, &mut env)
            };
            for (id, outcome) in left {
                let at = At::paused(self.streams.take_held(id));
                out.push((
                    id,
                    self.carry_out(id, outcome, at, &Clock::At(now), lent.store),
                ));
            }
        }
        out
    }

    /// Admission for a request whose flow is built (and estimated, when its body was read):
    /// the hold state machine decides, `carry_out` carries it out. `clock` is this call's, so
    /// the time is read at most once.
    fn admit(&mut self, id: u32, flow: Flow, at: At, clock: Clock, lent: &mut Lent) -> Reaction {
        let (outcome, clock) = {
            borrow_env!(self, lent, clock => g, holds, env);
            let outcome = holds.request(g, flow, id, &mut env);
            (outcome, env.clock.known())
        };
        let clock = clock.map_or(Clock::lazy(lent.clock), Clock::At);
        self.carry_out(id, outcome, at, &clock, lent.store)
    }

    /// Do what the hold decided: admitted here, it goes (by way of the fleet's limits when it
    /// has any); held, it stays paused; refused, it is answered (once its body has ended, so
    /// an HTTP/1.1 connection survives the answer).
    fn carry_out(
        &mut self,
        id: u32,
        outcome: Outcome,
        at: At,
        clock: &Clock,
        store: &dyn SharedStore,
    ) -> Reaction {
        match outcome {
            Outcome::Go(mut flow) => {
                let (gov, calls, turns) = (&self.gov, &mut self.fleet.calls, &mut self.fleet.turns);
                let (pool, account, store) = (flow.pool, flow.account, store);
                let turn_ms = || turn::turn_ms(gov.cooldowns().spread_ms(pool, account, store));
                let asked = gov.fleet().and_then(|fleet| {
                    let host = (clock, store);
                    FleetAsk::begin(fleet, &gov.cfg, calls, turns, &mut flow, host, turn_ms)
                });
                let Some((ask, calls)) = asked else {
                    return self.let_go(id, flow, at.from_tick);
                };
                self.streams
                    .set(id, Stream::fleet(flow, at.body_ended, ask));
                let effects = calls.into_iter().map(Effect::CallService).collect();
                Reaction::new(effects, Action::Pause)
            }
            Outcome::Held => {
                let body_ended = at.body_ended;
                self.streams.set(id, Stream::Held { body_ended });
                Reaction::pause()
            }
            Outcome::Reply(_, reply) => {
                let now = at.body_ended || !self.body.expected(|| clock.now());
                let until = || clock.now() + REQUEST_BODY_WAIT_MS;
                self.streams.answer(id, reply, now, at.buffered, until)
            }
        }
    }

    /// Forward a request every limit admitted.
    fn let_go(&mut self, id: u32, flow: Flow, from_tick: bool) -> Reaction {
        let mut effects = Vec::new();
        if let Some(name) = self.gov.pools().steered_to(&flow) {
            effects.push(Effect::Steer(name.to_string()));
        }
        self.streams.set(id, Stream::Upstream { flow, usage: None });
        if from_tick {
            effects.push(Effect::ResumeRequest);
            return Reaction::new(effects, Action::Pause);
        }
        Reaction::new(effects, Action::Continue)
    }

    /// An answer (`Some`: of call `seq`, or a failure to send it) for stream `id`'s admission,
    /// or (`None`) its calls overdue.
    fn fleet_step(
        &mut self,
        id: u32,
        answer: Option<(u32, ServiceReply)>,
        lent: &mut Lent,
    ) -> Reaction {
        let Some((flow, body_ended, mut ask)) = self.streams.take_fleet(id) else {
            return Reaction::pause(); // late: the stream went on without it
        };
        let peeked = ask.peeks();
        let progress = {
            borrow_env!(self, lent, Clock::lazy(lent.clock) => g, _holds, env);
            g.fleet()
                .map(|fleet| ask.step(fleet, &g.cfg, answer, &mut env))
        };
        let Some(progress) = progress else {
            return self.let_go(id, flow, true); // no fleet: nothing was ever asked
        };
        let effects = match progress {
            Progress::Done(verdict) => {
                self.fleet.answered_about(&flow, peeked, lent.clock);
                return self.fleet_verdict(id, flow, body_ended, verdict, lent);
            }
            Progress::Waiting => Vec::new(),
            Progress::Send(calls) => calls.into_iter().map(Effect::CallService).collect(),
        };
        self.streams.set(id, Stream::fleet(flow, body_ended, ask));
        Reaction::new(effects, Action::Pause)
    }

    /// Carry out the fleet's verdict on a request admitted here: it goes; or it gives back
    /// what it took (the local takes, the pace's release, the fleet's reservations) and waits
    /// or is answered, as any refused request.
    fn fleet_verdict(
        &mut self,
        id: u32,
        mut flow: Flow,
        body_ended: bool,
        verdict: Verdict,
        lent: &mut Lent,
    ) -> Reaction {
        let (outcome, now) = {
            let gov = self.gov.clone();
            borrow_env!(self, lent, Clock::lazy(lent.clock) => g, holds, env);
            let limits = g.limits();
            let refusal = match verdict.settle(|l| limits.take_fallback(&mut flow, l, &mut env)) {
                Ok(Admitted {
                    charges,
                    turn,
                    turn_ms,
                }) => {
                    if !charges.is_empty() {
                        flow.fleet_mut().charges = charges;
                        slots::arm(&g.cfg, &mut flow.fleet_mut().charges, env.now());
                    }
                    if let Some(t) = turn {
                        self.fleet
                            .turns
                            .took_for(&flow, t.reservation, turn_ms, env.now());
                    }
                    return self.let_go(id, flow, true);
                }
                Err(refusal) => refusal,
            };
            if let Blocked::Turn { .. } = refusal.blocked {
                g.cooldowns()
                    .held_elsewhere(flow.pool, flow.account, &mut env);
            }
            g.admission().undo(&mut flow, &mut env);
            if let Some(fleet) = gov.fleet() {
                let calls = &mut self.fleet.calls;
                calls.owe_releases(fleet, &gov.cfg, flow.pool, &refusal.release);
            }
            let outcome = if refusal.denied {
                let reply = g.replies().reply_for(&flow, &refusal.blocked, &mut env);
                Outcome::Reply(flow, reply)
            } else {
                holds.wait(g, flow, refusal.blocked, id, &mut env)
            };
            (outcome, env.now())
        };
        let at = At::paused(body_ended);
        self.carry_out(id, outcome, at, &Clock::At(now), lent.store)
    }

    /// Admit a request whose body was read: estimate it from the first `estimate::MAX_BODY`
    /// bytes Envoy buffered (`body_size` in all so far, when a body callback said; else what
    /// the buffer holds), then decide as for any request.
    fn admit_read(
        &mut self,
        id: u32,
        body_size: Option<usize>,
        body_ended: bool,
        lent: &mut Lent,
    ) -> Reaction {
        let Some(Stream::ReadingBody(read)) = self.streams.take(id) else {
            return Reaction::go_on();
        };
        let prefix = lent.io.request_body(id, BodyRead::bound(body_size));
        let flow = read.estimated(self.gov.pools(), &prefix, body_size);
        let at = At {
            body_ended,
            buffered: body_size.unwrap_or(0),
            from_tick: body_size.is_none() && !body_ended,
        };
        self.admit(id, flow, at, Clock::lazy(lent.clock), lent)
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
        }) = self.streams.take(id)
        else {
            return Reaction::go_on();
        };
        let body = stream::error_body(lent.io.response_body(id, MAX_ERROR_BODY), arrived);
        let clock = Clock::lazy(lent.clock);
        if overdue && body.is_empty() && !self.body.proven {
            self.body.missed(flow.pool, clock.now(), lent.metrics);
        }
        let governed = {
            borrow_env!(self, lent, clock => g, _holds, env);
            let headers = Headers::wire(&headers);
            g.responses()
                .on_error_body(&mut flow, status, &headers, &body, &mut env)
        };
        let key = TurnKey::of(&flow);
        self.streams.set(id, Stream::Upstream { flow, usage: None });
        let mut effects = Vec::new();
        if let Some(g) = governed {
            effects::set_headers(&mut effects, g.headers);
            self.fleet.learned(&self.gov, key, lent.store, lent.clock);
        }
        Reaction::new(effects, Action::Continue)
    }
}
