//! What a request is to the policy, as plain data: the parts of it the policy reads
//! (`RequestView`), and what the request path learned and took (`Flow`), carried to the
//! response path and the end of the same stream. No behaviour but the flow's own accessors:
//! the jobs that fill it live in their own modules (`pools`, `admission`, `limits`, `fleet`).

use crate::classify::Dialect;
use crate::cooldown::Ticket;
use crate::counting::Prediction;
use crate::estimate::Estimate;
use crate::headers::Headers;
use crate::inflight::Slot;
use crate::prefix::Prompt;

/// The request header that names the pool a request was steered to; Envoy routes on it. Only
/// the policy sets it: a client-sent one is removed before anything matches on it.
pub const STEERING_HEADER: &str = "x-llm-governor-pool";

/// The parts of a request the policy looks at.
pub struct RequestView<'a> {
    pub path: &'a [u8],
    pub authority: &'a [u8],
    pub headers: Headers<'a>,
}

impl<'a> RequestView<'a> {
    /// The view of a request whose header list carries its `:path` and `:authority`, as an
    /// Envoy header map does.
    pub fn of(headers: Headers<'a>) -> RequestView<'a> {
        RequestView {
            path: headers.get(":path").unwrap_or(b""),
            authority: headers.get(":authority").unwrap_or(b""),
            headers,
        }
    }
}

/// What the request path learned, carried to the response path of the same stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flow {
    /// The pool that governs the request: its own, or the fallback it was steered to.
    pub pool: usize,
    pub account: u64,
    /// The pool the request matched, and the account of the client's own credential.
    pub home_pool: usize,
    pub client_account: u64,
    pub home_dialect: Dialect,
    /// Per configured limit, the id of the keying header's value (header-keyed limits only).
    pub header_ids: Vec<u64>,
    /// The id of the request's model, for `model` keys (`keys::NO_MODEL` until known).
    pub model_id: u64,
    /// What the request body says it will cost, when it was read (a token limit reserves).
    pub estimate: Option<Estimate>,
    /// The prompt's cache breakpoints, when the body marks some and a token limit reserves.
    pub prompt: Option<Box<Prompt>>,
    /// What admission predicted the provider will count (cache reads, output), where a token
    /// limit predicts (None: nothing was predicted; one pointer, as most flows predict nothing).
    pub predicted: Option<Box<Prediction>>,
    /// The dialect for locally generated bodies (`auto` resolved from the request).
    pub dialect: Dialect,
    /// Consecutive failed cooldown rounds of this (pool, account), read with its cooldown:
    /// a success resets them.
    pub streak: u8,
    /// Per configured limit, the id of this request's key.
    pub limit_keys: Vec<u64>,
    /// Token buckets to settle with the response's usage.
    pub charges: Vec<Charge>,
    /// `max_in_flight` slots this request holds until its stream ends.
    pub slots: Vec<HeldSlot>,
    /// The release of the pace it took after a cooldown; its answer is owed to the pace.
    pub released: Option<Release>,
    /// How long the gateway held it, when it did.
    pub held_ms: Option<u64>,
    /// Until when it may be held: its arrival plus its hold budget.
    pub hold: HoldDeadline,
    /// Its class of held requests (`hold.classes`; the last is the implicit `default`).
    pub hold_class: usize,
    /// The id of its `hold.fair_key` header's value (0 without a header fair key).
    pub fair_id: u64,
    /// The client says this attempt is a retry (`x-stainless-retry-count` > 0).
    pub client_retry: bool,
    /// What fleet limits need of the request (None without fleet limits: one pointer).
    pub fleet: Option<Box<FleetFlow>>,
}

/// What a request under fleet limits carries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetFlow {
    /// What the local limits took, given back if the fleet refuses.
    pub taken: Vec<Taken>,
    /// (limit index, the raw key value) of fleet limits keyed by a header that is not a
    /// credential, or by model: what the descriptor carries.
    pub keys: Vec<(usize, String)>,
    /// Token budgets the fleet charged at admission, settled when the stream ends.
    pub charges: Vec<FleetCharge>,
}

/// A token budget a request is charged to when its stream ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Charge {
    /// The limit's index in the configuration.
    pub limit: usize,
    /// The bucket's shared-data key.
    pub key: String,
    /// Tokens reserved before forwarding; 0 when the budget is charged after the response.
    pub reserved: u64,
}

/// A release of the pace after a cooldown, as the request that took it keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Release {
    /// Its place among the pace's releases.
    pub ticket: Ticket,
    /// When it was handed out, Unix ms.
    pub at_ms: u64,
}

/// A `max_in_flight` slot a request holds until its stream ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldSlot {
    pub limit: usize,
    pub key: String,
    pub slot: Slot,
}

/// Something a request took from a local limit, to give back if a later limit (or the
/// fleet) refuses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taken {
    pub(crate) limit: usize,
    /// The bucket's shared-data key (empty for a leased take: it goes back to the lease).
    pub(crate) key: String,
    pub(crate) tokens: u64,
    /// From the worker's lease of this key id, not from shared data.
    pub(crate) leased: Option<u64>,
}

/// A token budget the fleet charged at admission, settled when the stream ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetCharge {
    pub limit: usize,
    /// The descriptor's key value (the same one is committed against).
    pub key: String,
    /// Reserved (or charged) at admission.
    pub amount: u64,
    /// The service's reservation id, when it holds one (a fleet slot: its hold on the cap).
    pub reservation: Option<String>,
    /// A fleet slot's hold on the cap's guard: the same id as `reservation` until either is
    /// taken again (`fleet::slots`); None once lost, or when the service has no guard.
    pub guard: Option<String>,
    /// The service has no guard for this slot's cap (its limits file lacks it).
    pub unguarded: bool,
    /// What the stream used, once known (0: the provider answered an error and counted none).
    pub settled: Option<u64>,
    /// A fleet slot's hold is taken again at this moment while its stream lasts (None: not a
    /// slot, or its renewal is under way; `fleet::slots`).
    pub renew_at_ms: Option<u64>,
}

/// Until when a request may be held: its arrival plus its hold budget (`deadline`), one
/// absolute moment. It is fixed the first time anything needs it, in the request's arrival
/// callback with that callback's clock (the worker fixes it before a stream leaves that
/// callback unforwarded), so a request that goes at once never reads the clock for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldDeadline {
    budget_ms: u64,
    until_ms: Option<u64>,
}

impl HoldDeadline {
    /// A request that may be held `budget_ms` from its arrival (0: not at all).
    pub fn new(budget_ms: u64) -> HoldDeadline {
        HoldDeadline {
            budget_ms,
            until_ms: None,
        }
    }

    /// The deadline, Unix ms (0: it may not be held); `arrival` is read the first time only.
    pub fn fix(&mut self, arrival: impl FnOnce() -> u64) -> u64 {
        match (self.budget_ms, self.until_ms) {
            (0, _) => 0,
            (_, Some(until)) => until,
            (budget, None) => *self.until_ms.insert(arrival().saturating_add(budget)),
        }
    }

    /// The deadline once fixed (0 before, or when it may not be held).
    pub fn until_ms(&self) -> u64 {
        self.until_ms.unwrap_or(0)
    }
}

impl Flow {
    /// What admission predicted (nothing, when it predicted nothing).
    pub fn prediction(&self) -> Prediction {
        self.predicted.as_deref().copied().unwrap_or_default()
    }

    /// Whether its stream's end must be reported: slots to give back, a pace answer owed.
    pub fn owes_at_end(&self) -> bool {
        !self.slots.is_empty() || self.released.is_some() || self.fleet_charged()
    }

    /// Whether the fleet charged it a token budget, settled at the end.
    pub fn fleet_charged(&self) -> bool {
        self.fleet.as_ref().is_some_and(|f| !f.charges.is_empty())
    }

    /// What fleet limits need of it (made on first use).
    /// When a fleet slot of this flow is next taken again (`fleet::slots`).
    pub fn slot_renewal_ms(&self) -> Option<u64> {
        let fleet = self.fleet.as_ref()?;
        fleet.charges.iter().filter_map(|c| c.renew_at_ms).min()
    }

    pub fn fleet_mut(&mut self) -> &mut FleetFlow {
        self.fleet.get_or_insert_with(Box::default)
    }

    /// Whether it holds a token reservation to settle (locally or at the fleet).
    pub fn reserves(&self) -> bool {
        self.charges.iter().any(|c| c.reserved > 0) || self.fleet_charged()
    }

    /// Whether something it took must be settled with the usage its response reports.
    pub fn charged(&self) -> bool {
        !self.charges.is_empty() || self.fleet_charged()
    }
}
