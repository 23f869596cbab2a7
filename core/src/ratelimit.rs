//! The provider's own rate-limit headers, read into one snapshot per response.
//!
//! OpenAI and Azure: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (resets are Go
//! durations). Anthropic: `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
//! {limit,remaining,reset}` (resets are RFC 3339 instants). IETF drafts: the structured
//! `RateLimit` / `RateLimit-Policy` fields and the older `RateLimit-Limit/-Remaining/-Reset`.

use crate::headers::{self, same_name as same, Headers};
use crate::time;

/// A rate-limit dimension a provider counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dimension {
    Requests,
    Tokens,
    InputTokens,
    OutputTokens,
}

impl Dimension {
    pub const ALL: [Dimension; 4] = [
        Dimension::Requests,
        Dimension::Tokens,
        Dimension::InputTokens,
        Dimension::OutputTokens,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Requests => "requests",
            Dimension::Tokens => "tokens",
            Dimension::InputTokens => "input_tokens",
            Dimension::OutputTokens => "output_tokens",
        }
    }
}

/// Limit, remaining and time-to-reset of one dimension, each only when the provider said so.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub limit: Option<u64>,
    pub remaining: Option<u64>,
    pub reset_ms: Option<u64>,
}

impl Window {
    fn is_empty(&self) -> bool {
        self.limit.is_none() && self.remaining.is_none() && self.reset_ms.is_none()
    }
}

/// Everything one response said about the caller's rate limits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub requests: Window,
    pub tokens: Window,
    pub input_tokens: Window,
    pub output_tokens: Window,
    /// Its resets were durations (OpenAI, the IETF fields), which count from when the provider
    /// took the request, not from when its answer arrived; Anthropic's are instants.
    pub durations: bool,
}

impl Snapshot {
    pub fn window(&self, d: Dimension) -> &Window {
        match d {
            Dimension::Requests => &self.requests,
            Dimension::Tokens => &self.tokens,
            Dimension::InputTokens => &self.input_tokens,
            Dimension::OutputTokens => &self.output_tokens,
        }
    }

    fn window_mut(&mut self, d: Dimension) -> &mut Window {
        match d {
            Dimension::Requests => &mut self.requests,
            Dimension::Tokens => &mut self.tokens,
            Dimension::InputTokens => &mut self.input_tokens,
            Dimension::OutputTokens => &mut self.output_tokens,
        }
    }

    pub fn is_empty(&self) -> bool {
        Dimension::ALL.iter().all(|d| self.window(*d).is_empty())
    }

    /// Dimensions the provider reports as used up (remaining = 0).
    pub fn exhausted(&self) -> impl Iterator<Item = Dimension> + '_ {
        Dimension::ALL
            .into_iter()
            .filter(|d| self.window(*d).remaining == Some(0))
    }

    /// The longest reset among the exhausted dimensions: the earliest moment every exhausted
    /// dimension has room again.
    pub fn exhausted_reset_ms(&self) -> Option<u64> {
        self.exhausted_wait_ms(None)
    }

    /// How many more requests the provider says fit now: its remaining requests and, for a
    /// request known to need `tokens`, its remaining tokens over that need (the fewer of the
    /// two). None when it reports neither.
    pub fn requests_that_fit(&self, tokens: Option<u64>) -> Option<u64> {
        let by_tokens = tokens
            .filter(|n| *n > 0)
            .zip(self.tokens.remaining)
            .map(|(need, left)| left / need);
        match (self.requests.remaining, by_tokens) {
            (Some(r), Some(t)) => Some(r.min(t)),
            (r, t) => r.or(t),
        }
    }

    /// Preemptive pacing per dimension: how long until a request needing `need` fits every
    /// dimension the provider reports used up (remaining 0). A token dimension with a known need
    /// and limit has it back after `reset × need / limit` (the bucket refills evenly until full
    /// at the reset): the input a request like this one reserves for input tokens, its output
    /// for output tokens; others wait the whole reset. A remaining above 0 but below the need
    /// does not cool: the next request may need much less (its prompt read from the cache), and
    /// the gateway's own buckets pace what it knows. None when nothing is used up.
    pub fn short_wait_ms(&self, need: &Need) -> Option<u64> {
        self.exhausted()
            .filter_map(|d| {
                let w = self.window(d);
                let reset = w.reset_ms?;
                Some(match (need.of(d), w.limit) {
                    (Some(n), Some(limit)) if limit > 0 => {
                        let part = u128::from(reset) * u128::from(n) / u128::from(limit);
                        u64::try_from(part).unwrap_or(u64::MAX).clamp(1, reset)
                    }
                    _ => reset,
                })
            })
            .max()
    }

    /// How long until a request needing `tokens` of every token dimension fits every exhausted
    /// dimension (`short_wait_ms` with that need in each).
    pub fn exhausted_wait_ms(&self, tokens: Option<u64>) -> Option<u64> {
        self.short_wait_ms(&Need {
            tokens,
            input_tokens: tokens,
            output_tokens: tokens,
        })
    }
}

/// What a request needs of each token dimension, where it is known (its reservations).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Need {
    pub tokens: Option<u64>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
}

impl Need {
    pub fn of(&self, d: Dimension) -> Option<u64> {
        match d {
            Dimension::Requests => None,
            Dimension::Tokens => self.tokens,
            Dimension::InputTokens => self.input_tokens,
            Dimension::OutputTokens => self.output_tokens,
        }
    }

    /// The most a dimension needs: for a provider that reports one token dimension.
    pub fn most(&self) -> Option<u64> {
        [self.tokens, self.input_tokens, self.output_tokens]
            .into_iter()
            .flatten()
            .max()
    }
}

fn text(v: Option<&[u8]>) -> Option<&str> {
    headers::value_str(v?)
}

/// A header value that is a non-negative integer (absurd values saturate).
fn uint(v: Option<&[u8]>) -> Option<u64> {
    time::whole_number(v?.trim_ascii())
}

/// OpenAI and Azure: `x-ratelimit-{limit,remaining,reset}-{dimension}`.
const OPENAI_PREFIX: &[u8] = b"x-ratelimit-";
const OPENAI: [(Dimension, &[u8]); 2] = [
    (Dimension::Requests, b"requests"),
    (Dimension::Tokens, b"tokens"),
];

/// Anthropic: `anthropic-ratelimit-{dimension}-{limit,remaining,reset}`.
const ANTHROPIC_PREFIX: &[u8] = b"anthropic-ratelimit-";
const ANTHROPIC: [(Dimension, &[u8]); 4] = [
    (Dimension::Requests, b"requests"),
    (Dimension::Tokens, b"tokens"),
    (Dimension::InputTokens, b"input-tokens"),
    (Dimension::OutputTokens, b"output-tokens"),
];

/// The words of a window's three fields, in the order of a `Family` entry.
const FIELDS: [&[u8]; 3] = [b"limit", b"remaining", b"reset"];

const IETF_PREFIX: &[u8] = b"ratelimit";
const IETF: [&str; 5] = [
    "ratelimit",
    "ratelimit-policy",
    "ratelimit-limit",
    "ratelimit-remaining",
    "ratelimit-reset",
];

/// The first value of every rate-limit header of one family, (limit, remaining, reset) per
/// dimension, as `Headers::get` would find them.
type Family<'a, const N: usize> = [[Option<&'a [u8]>; 3]; N];

/// Whether `name` starts with `prefix` (lowercase), in any case: exactly first, as Envoy
/// hands names over lowercased.
fn starts_with(name: &[u8], prefix: &[u8]) -> bool {
    // The first byte rejects almost every other header before a compare call.
    let (Some(first), Some(want)) = (name.first(), prefix.first()) else {
        return prefix.is_empty();
    };
    first.to_ascii_lowercase() == *want
        && name.len() >= prefix.len()
        && same(&name[..prefix.len()], prefix)
}

/// Which field word `word` is (an index into `FIELDS`), in any case.
fn field(word: &[u8]) -> Option<usize> {
    FIELDS.iter().position(|f| same(word, f))
}

/// The (dimension, field) slot of an OpenAI name past its prefix: `{field}-{dimension}`.
fn openai_slot(rest: &[u8]) -> Option<(usize, usize)> {
    OPENAI.iter().enumerate().find_map(|(d, (_, dim))| {
        let (word, tail) = rest.split_at_checked(rest.len().checked_sub(dim.len() + 1)?)?;
        let named = tail.first() == Some(&b'-') && same(&tail[1..], dim);
        named.then(|| Some((d, field(word)?)))?
    })
}

/// The (dimension, field) slot of an Anthropic name past its prefix: `{dimension}-{field}`.
fn anthropic_slot(rest: &[u8]) -> Option<(usize, usize)> {
    ANTHROPIC.iter().enumerate().find_map(|(d, (_, dim))| {
        let (head, word) = rest.split_at_checked(dim.len())?;
        let named = same(head, dim) && word.first() == Some(&b'-');
        named.then(|| Some((d, field(&word[1..])?)))?
    })
}

/// Keep `value` in its slot unless an earlier header of the same name filled it (the first
/// value wins, as `Headers::get` would find it). Each name has one slot in any case.
fn keep<'a, const N: usize>(
    found: &mut Family<'a, N>,
    slot: Option<(usize, usize)>,
    value: &'a [u8],
) {
    if let Some((d, f)) = slot {
        found[d][f].get_or_insert(value);
    }
}

/// Read every rate-limit header family present on a response. Runs on every response, so it
/// allocates nothing and looks at each header once: a header outside the three families costs
/// three prefix compares.
pub fn parse(h: &Headers, now: &dyn Fn() -> u64) -> Snapshot {
    let mut openai: Family<2> = Default::default();
    let mut anthropic: Family<4> = Default::default();
    let mut ietf: [Option<&[u8]>; 5] = Default::default();
    let (mut any_openai, mut any_anthropic, mut any_ietf) = (false, false, false);
    h.for_each(|name, value| {
        if starts_with(name, OPENAI_PREFIX) {
            any_openai = true;
            keep(
                &mut openai,
                openai_slot(&name[OPENAI_PREFIX.len()..]),
                value,
            );
        } else if starts_with(name, ANTHROPIC_PREFIX) {
            any_anthropic = true;
            let rest = &name[ANTHROPIC_PREFIX.len()..];
            keep(&mut anthropic, anthropic_slot(rest), value);
        } else if starts_with(name, IETF_PREFIX) {
            any_ietf = true;
            if let Some(i) = IETF.iter().position(|n| same(name, n.as_bytes())) {
                ietf[i].get_or_insert(value);
            }
        }
    });
    let mut snap = Snapshot::default();
    if any_openai {
        for ((d, _), [limit, remaining, reset]) in OPENAI.iter().zip(openai) {
            let w = snap.window_mut(*d);
            w.limit = uint(limit);
            w.remaining = uint(remaining);
            w.reset_ms = text(reset).and_then(time::parse_go_duration_ms);
            snap.durations |= w.reset_ms.is_some();
        }
    }
    // Anthropic's family fills what OpenAI headers did not.
    if any_anthropic {
        for ((d, _), [limit, remaining, reset]) in ANTHROPIC.iter().zip(anthropic) {
            let w = snap.window_mut(*d);
            w.limit = w.limit.or_else(|| uint(limit));
            w.remaining = w.remaining.or_else(|| uint(remaining));
            w.reset_ms = w.reset_ms.or_else(|| {
                text(reset)
                    .and_then(time::parse_rfc3339_ms)
                    .and_then(|at| time::until(at, now()))
            });
        }
    }
    // IETF fields describe requests unless a provider-specific family already did.
    if any_ietf && snap.requests.is_empty() {
        snap.requests = parse_ietf(&ietf);
        snap.durations |= snap.requests.reset_ms.is_some();
    }
    snap
}

/// `RateLimit: "default";r=50;t=30`, `RateLimit-Policy: "default";q=100;w=60`, or the older
/// `RateLimit-Limit: 100`, `RateLimit-Remaining: 50`, `RateLimit-Reset: 30` (seconds), in the
/// order of `IETF`.
fn parse_ietf(v: &[Option<&[u8]>; 5]) -> Window {
    let [field, policy, limit, remaining, reset] = *v;
    let mut w = Window::default();
    if let Some(v) = text(field) {
        w.remaining = sf_param(v, "r");
        w.reset_ms = sf_param(v, "t").map(|s| s.saturating_mul(1000).min(time::MAX_PARSED_MS));
    }
    if let Some(v) = text(policy) {
        w.limit = sf_param(v, "q");
    }
    w.limit = w.limit.or_else(|| uint(limit));
    w.remaining = w.remaining.or_else(|| uint(remaining));
    w.reset_ms = w
        .reset_ms
        .or_else(|| text(reset).and_then(|s| time::parse_decimal_ms(s, 1000)));
    w
}

/// The integer parameter `key` of the first list member of a structured field.
fn sf_param(v: &str, key: &str) -> Option<u64> {
    let first = v.split(',').next()?;
    first.split(';').skip(1).find_map(|p| {
        let (k, val) = p.trim().split_once('=')?;
        (k.trim() == key)
            .then(|| val.trim())
            .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .map(|s| s.parse::<u64>().unwrap_or(u64::MAX))
    })
}
