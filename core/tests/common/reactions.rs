//! Reading what a worker asked of its host: the effects of its reactions, and what the client
//! sees of a response (the headers the worker set on it).

use llm_governor_core::classify::Class;
use llm_governor_core::fleet::grpc::ServiceCall;
use llm_governor_core::reply::LocalReply;
use llm_governor_core::worker::{Action, Effect, Reaction};

/// What the client is told of a response the worker governed, read from the headers it set.
#[derive(Clone, Debug)]
pub struct Told {
    pub class: Class,
    /// `retry-after-ms`.
    pub delay_ms: u64,
    /// Every header the worker set on the response, in order (the steered and held ones too).
    pub headers: Vec<(&'static str, String)>,
}

/// What the client is told of a response, from the reactions to its callbacks: None when the
/// worker did not govern it (no class among the headers it set).
pub fn told(reactions: &[Reaction]) -> Option<Told> {
    let headers: Vec<_> = reactions.iter().flat_map(set_headers).collect();
    let value = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v);
    let class = value("x-llm-governor-class")?;
    let class = [Class::RateLimited, Class::QuotaExhausted, Class::Overloaded]
        .into_iter()
        .find(|c| c.as_str() == class)
        .unwrap_or_else(|| panic!("unknown class {class}"));
    let delay_ms = value("retry-after-ms")
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("a governed response without retry-after-ms: {headers:?}"));
    Some(Told {
        class,
        delay_ms,
        headers,
    })
}

/// What `pick` finds in a reaction's effects, in order.
fn each<'r, T>(r: &'r Reaction, pick: impl Fn(&'r Effect) -> Option<T>) -> Vec<T> {
    r.effects.iter().filter_map(pick).collect()
}

/// The response headers a reaction sets.
pub fn set_headers(r: &Reaction) -> Vec<(&'static str, String)> {
    let sets = each(r, |e| match e {
        Effect::SetResponseHeaders(h) => Some(h.clone()),
        _ => None,
    });
    sets.into_iter().flatten().collect()
}

/// The calls to the fleet's service a reaction makes.
pub fn calls(r: &Reaction) -> Vec<ServiceCall> {
    each(r, |e| match e {
        Effect::CallService(c) => Some(c.clone()),
        _ => None,
    })
}

/// The local answers a reaction sends.
fn sent(r: &Reaction) -> Vec<&LocalReply> {
    each(r, |e| match e {
        Effect::SendReply(reply) => Some(reply),
        _ => None,
    })
}

/// The local answer a reaction sends, if any.
pub fn replied(r: &Reaction) -> Option<&LocalReply> {
    sent(r).into_iter().next()
}

/// The statuses of the local answers a reaction sends.
pub fn replies(r: &Reaction) -> Vec<u32> {
    sent(r).iter().map(|reply| reply.status).collect()
}

/// A reaction that leaves the stream paused after `effects`.
pub fn paused(effects: Vec<Effect>) -> Reaction {
    Reaction {
        effects,
        action: Action::Pause,
    }
}
