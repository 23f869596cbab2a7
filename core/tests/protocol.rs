//! The protocol between a worker and its host (`protocol`), written once for both hosts, tested
//! over a fake host: effects applied in order, a failed effect answered by the worker, a
//! reaction for a stream that is gone, calls to the fleet's service sent and routed, owed calls
//! that cannot be sent, and the load-time check of the service's cluster.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use llm_governor_core::effects::{Action, Direction, Effect, Lent, Reaction};
use llm_governor_core::fleet::grpc::{Method, ServiceCall, ServiceReply};
use llm_governor_core::headers::owned;
use llm_governor_core::metrics::Counter;
use llm_governor_core::protocol::{self, Host as ProtocolHost, StreamOps};
use llm_governor_core::reply::LocalReply;
use llm_governor_core::worker::{Stage, Worker};
use std::cell::RefCell;
use std::collections::HashSet;

/// A host over the tests' `Host`: what it did to each stream, which primitives fail, which
/// streams are gone, and the calls it sent.
#[derive(Default)]
struct Record {
    done: Vec<(u32, String)>,
    fails: HashSet<&'static str>,
    gone: HashSet<u32>,
    refuse_calls: bool,
    sent: Vec<(Option<u32>, ServiceCall)>,
}

struct Fake {
    host: RefCell<Host>,
    record: RefCell<Record>,
}

struct On<'a> {
    id: Option<u32>,
    record: &'a RefCell<Record>,
}

impl On<'_> {
    fn did(&self, what: &'static str, detail: String) -> bool {
        let mut r = self.record.borrow_mut();
        r.done
            .push((self.id.unwrap_or(0), format!("{what} {detail}")));
        !r.fails.contains(what)
    }
}

impl StreamOps for On<'_> {
    fn request_header(&self, name: &str, value: Option<&str>) -> bool {
        self.did("request_header", format!("{name}={value:?}"))
    }
    fn response_header(&self, name: &str, value: &str) -> bool {
        self.did("response_header", format!("{name}={value}"))
    }
    fn filter_state(&self, key: &str, value: &str) -> bool {
        self.did("filter_state", format!("{key}={value}"))
    }
    fn drop_request_body(&self, n: usize) -> bool {
        self.did("drop_request_body", n.to_string())
    }
    fn send_reply(&self, reply: &LocalReply) -> bool {
        self.did("send_reply", reply.status.to_string())
    }
    fn resume(&self, direction: Direction) -> bool {
        self.did("resume", format!("{direction:?}"))
    }
}

impl<'a> ProtocolHost for &'a Fake {
    type Stream = On<'a>;

    fn with_worker<T>(
        &self,
        _: Option<u32>,
        f: impl FnOnce(&mut Worker, &mut Lent) -> T,
    ) -> Option<T> {
        let mut host = self.host.try_borrow_mut().ok()?;
        Some(host.call(f))
    }

    fn current(&self, id: u32) -> On<'a> {
        On {
            id: Some(id),
            record: &self.record,
        }
    }

    fn stream(&self, id: u32) -> Option<On<'a>> {
        (!self.record.borrow().gone.contains(&id)).then(|| self.current(id))
    }

    fn send(&self, stream: Option<&On<'a>>, call: &ServiceCall) -> Option<u64> {
        let mut r = self.record.borrow_mut();
        if r.refuse_calls {
            return None;
        }
        r.sent.push((stream.and_then(|s| s.id), call.clone()));
        Some(1000 + r.sent.len() as u64)
    }
}

impl Fake {
    fn new(cfg: &str) -> Fake {
        Fake {
            host: RefCell::new(Host::new(cfg)),
            record: RefCell::default(),
        }
    }

    fn done(&self) -> Vec<(u32, String)> {
        std::mem::take(&mut self.record.borrow_mut().done)
    }

    /// Request headers of stream `id` (no body) through the protocol.
    fn arrive(&self, id: u32, headers: &[(&str, &str)]) -> Action {
        let mut all = vec![(":path", "/v1/chat/completions")];
        all.extend_from_slice(headers);
        let hs = owned(&all);
        let v = view("/v1/chat/completions", &hs);
        protocol::callback(&self, id, |w, id, lent| {
            w.on_request_headers(id, &v, true, lent)
        })
    }

    fn stage(&self, id: u32) -> Stage {
        self.host.borrow().worker.stage(id)
    }
}

const COOLING: &str = r#"{"hold": {"max_ms": 0}}"#;

/// Cool the default pool's account `k` for `ms` (a 429 with retry-after).
fn cool(fake: &Fake, ms: u64) {
    let mut host = fake.host.borrow_mut();
    let flow = host.forward("/v1/chat/completions", &[("authorization", "Bearer k")]);
    let secs = (ms / 1000).to_string();
    host.respond(&flow, 429, &[("retry-after", &secs)], "");
}

#[test]
fn a_reactions_effects_are_applied_in_order_and_its_action_returned() {
    let fake = Fake::new(COOLING);
    cool(&fake, 5000);
    let action = fake.arrive(1, &[("authorization", "Bearer k")]);
    assert_eq!(action, Action::Pause);
    let done: Vec<String> = fake.done().into_iter().map(|(_, d)| d).collect();
    assert!(
        done[0].starts_with("filter_state llm_governor.class="),
        "{done:?}"
    );
    assert_eq!(
        done.last().map(String::as_str),
        Some("send_reply 429"),
        "{done:?}"
    );
}

#[test]
fn a_failed_effect_is_answered_by_the_worker_and_the_rest_is_not_applied() {
    // A local answer that cannot be sent: the request goes on, ungoverned, rather than hang.
    let fake = Fake::new(COOLING);
    cool(&fake, 5000);
    fake.record.borrow_mut().fails.insert("send_reply");
    let action = fake.arrive(1, &[("authorization", "Bearer k")]);
    assert_eq!(action, Action::Continue);
    // A client-sent steering header that cannot be removed: refused, nothing else applied.
    let fake = Fake::new(COOLING);
    fake.record.borrow_mut().fails.insert("request_header");
    let action = fake.arrive(2, &[("x-llm-governor-pool", "mine")]);
    assert_eq!(action, Action::Pause);
    let done = fake.done();
    assert_eq!(done.len(), 2, "{done:?}");
    assert_eq!(done[1].1, "send_reply 400");
}

#[test]
fn a_busy_worker_lets_the_stream_go_on_ungoverned() {
    let fake = Fake::new(COOLING);
    cool(&fake, 5000);
    let _busy = fake.host.borrow_mut();
    let hs = owned(&[
        (":path", "/v1/chat/completions"),
        ("authorization", "Bearer k"),
    ]);
    let v = view("/v1/chat/completions", &hs);
    let action = protocol::callback(&&fake, 1, |w, id, lent| {
        w.on_request_headers(id, &v, true, lent)
    });
    assert_eq!(action, Action::Continue);
}

const HOLDING: &str = r#"{"hold": {"max_ms": 10000}}"#;

#[test]
fn a_reaction_for_a_stream_that_is_gone_ends_it() {
    let fake = Fake::new(HOLDING);
    cool(&fake, 2000);
    assert_eq!(
        fake.arrive(1, &[("authorization", "Bearer k")]),
        Action::Pause
    );
    assert_eq!(fake.stage(1), Stage::Held);
    fake.record.borrow_mut().gone.insert(1);
    fake.host.borrow_mut().advance(2_001);
    protocol::tick(&&fake);
    assert_eq!(fake.stage(1), Stage::Done, "ended, not left held");
    assert_eq!(fake.host.borrow().worker.held(), 0);
    assert!(
        fake.done().is_empty(),
        "nothing applied to a stream that is gone"
    );
}

#[test]
fn a_released_request_is_resumed_from_outside_its_callbacks() {
    let fake = Fake::new(HOLDING);
    cool(&fake, 2000);
    fake.arrive(1, &[("authorization", "Bearer k")]);
    fake.done();
    fake.host.borrow_mut().advance(2_001);
    protocol::tick(&&fake);
    assert_eq!(fake.done(), vec![(1, "resume Request".to_string())]);
    assert_eq!(fake.stage(1), Stage::Upstream);
}

const FLEET: &str = r#"{"fleet": {"cluster": "rls", "timeout_ms": 50, "on_error": "deny"},
  "limits": [{"name": "rpm", "key": "header:x-tenant-id", "requests_per_minute": 5, "scope": "fleet"}],
  "hold": {"max_ms": 0}}"#;

#[test]
fn a_streams_call_is_sent_for_it_and_its_answer_routed_back_to_it() {
    let fake = Fake::new(FLEET);
    assert_eq!(fake.arrive(7, &[("x-tenant-id", "acme")]), Action::Pause);
    let sent = fake.record.borrow().sent.clone();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].0, Some(7));
    assert_eq!(sent[0].1.method, Method::ShouldRateLimit);
    assert_eq!(fake.stage(7), Stage::AwaitingFleet);
    // An answer for a token this worker never sent, or for another stream, changes nothing.
    let ok = rls_answer(1, None);
    protocol::call_done(&&fake, Some(7), 999, ServiceReply::Message(&ok));
    protocol::call_done(&&fake, Some(8), 1001, ServiceReply::Message(&ok));
    assert_eq!(fake.stage(7), Stage::AwaitingFleet);
    fake.done();
    protocol::call_done(&&fake, Some(7), 1001, ServiceReply::Message(&ok));
    assert_eq!(fake.done(), vec![(7, "resume Request".to_string())]);
    assert_eq!(fake.stage(7), Stage::Upstream);
    // Its answer is taken once.
    protocol::call_done(&&fake, Some(7), 1001, ServiceReply::Message(&ok));
    assert!(fake.done().is_empty());
}

#[test]
fn a_call_that_cannot_be_sent_is_decided_by_on_error() {
    let fake = Fake::new(FLEET);
    fake.record.borrow_mut().refuse_calls = true;
    assert_eq!(fake.arrive(7, &[("x-tenant-id", "acme")]), Action::Pause);
    let done = fake.done();
    assert_eq!(
        done.last().map(|d| d.1.as_str()),
        Some("send_reply 429"),
        "{done:?}"
    );
    assert_eq!(
        fake.host.borrow().metrics.count_of(0, Counter::FleetErrors),
        1
    );
}

const FLEET_TPM: &str = r#"{"fleet": {"cluster": "rls", "timeout_ms": 50},
  "limits": [{"name": "tpm", "key": "header:x-tenant-id", "tokens_per_minute": 100000, "scope": "fleet"}],
  "hold": {"max_ms": 0}}"#;

#[test]
fn owed_calls_are_sent_from_outside_every_stream_and_one_not_sent_is_a_failed_call() {
    let fake = Fake::new(FLEET_TPM);
    // Streams 1 and 2 reserve, go, and end: each owes a commit.
    for id in [1, 2] {
        {
            let mut host = fake.host.borrow_mut();
            let body = br#"{"model":"m","max_tokens":10,"messages":[]}"#;
            host.io.request_bodies.insert(id, body.to_vec());
        }
        let hs = owned(&[(":path", "/v1/chat/completions"), ("x-tenant-id", "acme")]);
        let v = view("/v1/chat/completions", &hs);
        protocol::callback(&&fake, id, |w, id, lent| {
            w.on_request_headers(id, &v, false, lent)
        });
        protocol::callback(&&fake, id, |w, id, lent| {
            w.on_request_body(id, 40, true, lent)
        });
        let token = fake.record.borrow().sent.len() as u64 + 1000;
        let granted = reserve_answer(1, "r");
        protocol::call_done(&&fake, Some(id), token, ServiceReply::Message(&granted));
        assert_eq!(fake.stage(id), Stage::Upstream);
        protocol::end(&&fake, id);
    }
    let before = fake.record.borrow().sent.len();
    protocol::send_owed(&&fake);
    let sent = fake.record.borrow().sent.clone();
    assert_eq!(sent.len(), before + 2);
    assert!(sent[before..]
        .iter()
        .all(|(s, c)| s.is_none() && c.method == Method::Commit));
    // The answer of an owed call is only counted; one the host could not send is an error.
    let ok = reserve_answer(1, "");
    protocol::call_done(
        &&fake,
        None,
        before as u64 + 1001,
        ServiceReply::Message(&ok),
    );
    assert_eq!(
        fake.host
            .borrow()
            .metrics
            .count_of(0, Counter::FleetCallsOk),
        3
    );
    {
        let mut host = fake.host.borrow_mut();
        host.io
            .request_bodies
            .insert(3, br#"{"model":"m","messages":[]}"#.to_vec());
    }
    let hs = owned(&[(":path", "/v1/chat/completions"), ("x-tenant-id", "acme")]);
    let v = view("/v1/chat/completions", &hs);
    protocol::callback(&&fake, 3, |w, id, lent| {
        w.on_request_headers(id, &v, false, lent)
    });
    protocol::callback(&&fake, 3, |w, id, lent| {
        w.on_request_body(id, 30, true, lent)
    });
    let token = fake.record.borrow().sent.len() as u64 + 1000;
    let granted = reserve_answer(1, "r3");
    protocol::call_done(&&fake, Some(3), token, ServiceReply::Message(&granted));
    protocol::end(&&fake, 3);
    fake.record.borrow_mut().refuse_calls = true;
    let errors = fake.host.borrow().metrics.count_of(0, Counter::FleetErrors);
    protocol::send_owed(&&fake);
    assert_eq!(
        fake.host.borrow().metrics.count_of(0, Counter::FleetErrors),
        errors + 1
    );
    assert!(
        fake.host.borrow_mut().worker.calls().take_owed().is_empty(),
        "not owed twice"
    );
}

#[test]
fn a_fleet_cluster_envoy_lacks_is_refused_at_load() {
    let cfg = FLEET.as_bytes();
    let asked = RefCell::new(Vec::new());
    let refused = protocol::load(cfg, test_key(), |c| {
        asked.borrow_mut().push(c.to_string());
        false
    });
    assert_eq!(
        refused.err().as_deref(),
        Some(r#"invalid configuration: fleet.cluster: Envoy has no cluster "rls""#)
    );
    assert_eq!(*asked.borrow(), vec!["rls".to_string()]);
    assert!(protocol::load(cfg, test_key(), |_| true).is_ok());
    // Without a fleet, no cluster is asked for.
    assert!(protocol::load(b"{}", test_key(), |_| panic!("asked")).is_ok());
}

#[test]
fn a_reaction_from_outside_a_callback_that_says_continue_resumes_the_request() {
    let fake = Fake::new(COOLING);
    protocol::apply_later(&&fake, 9, Reaction::go_on());
    assert_eq!(fake.done(), vec![(9, "resume Request".to_string())]);
    let effects = vec![Effect::ResumeResponse];
    let r = Reaction {
        effects,
        action: Action::Pause,
    };
    protocol::apply_later(&&fake, 9, r);
    assert_eq!(fake.done(), vec![(9, "resume Response".to_string())]);
}
