//! The prompt prefixes an (account, model) has in the provider's cache, as the filter saw it
//! answer: one fixed-width record per (account, model) in shared data (`SLOTS` keyed hashes
//! with their expiry, never content), counted against `max_keys` like a bucket. A request whose
//! prompt has a remembered prefix at one of its candidates is predicted to be read from the
//! cache (`hit`); a success remembers its breakpoints and renews the prefix it read
//! (`remember`), as the provider does (5 minutes, renewed on every read; 1 hour for
//! `"ttl": "1h"`).

use crate::env::Env;
use crate::keys;
use crate::keyspace;
use crate::prefix::{Candidate, Prompt};
use crate::store::{Reader, Record, Writer};

/// Prefixes remembered per (account, model): a dozen agents, each with a system prompt and a
/// conversation breakpoint or two, fit; past it the one expiring first is replaced.
pub const SLOTS: usize = 32;
const SLOT_LEN: usize = 20;
pub const ENCODED_LEN: usize = SLOTS * SLOT_LEN;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slot {
    hash: u64,
    expires_ms: u64,
    /// How long a read renews it for, in seconds.
    ttl_s: u32,
}

/// The record: fixed-width, so a value of another length is not trusted (reads as empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remembered {
    slots: [Slot; SLOTS],
}

impl Default for Remembered {
    fn default() -> Self {
        Remembered {
            slots: [Slot::default(); SLOTS],
        }
    }
}

impl Remembered {
    /// The first (longest) candidate the cache holds at `now`.
    pub fn hit(&self, candidates: &[Candidate], now: u64) -> Option<usize> {
        candidates.iter().position(|c| {
            self.slots
                .iter()
                .any(|s| s.hash == c.hash && s.expires_ms > now)
        })
    }

    /// After a success: the prefix read (`hit`) renewed, every breakpoint written (or renewed).
    pub fn remember(mut self, prompt: &Prompt, hit: Option<usize>, now: u64) -> Remembered {
        if let Some(c) = hit.and_then(|i| prompt.candidates.get(i)) {
            if let Some(s) = self.slots.iter_mut().find(|s| s.hash == c.hash) {
                s.expires_ms = s.expires_ms.max(now + u64::from(s.ttl_s) * 1000);
            }
        }
        for bp in &prompt.breakpoints {
            let expires_ms = now.saturating_add(bp.ttl_ms);
            let ttl_s = u32::try_from(bp.ttl_ms / 1000).unwrap_or(u32::MAX);
            let at = match self.slots.iter().position(|s| s.hash == bp.hash) {
                Some(i) => i,
                // The slot expiring first (an empty one expired long ago).
                None => (0..SLOTS)
                    .min_by_key(|&i| self.slots[i].expires_ms)
                    .unwrap_or(0),
            };
            let s = &mut self.slots[at];
            if s.hash != bp.hash {
                *s = Slot::default();
            }
            *s = Slot {
                hash: bp.hash,
                expires_ms: s.expires_ms.max(expires_ms),
                ttl_s: s.ttl_s.max(ttl_s),
            };
        }
        self
    }
}

impl Record for Remembered {
    fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_LEN);
        for s in &self.slots {
            let w: [u8; SLOT_LEN] = Writer::default()
                .u64(s.hash)
                .u64(s.expires_ms)
                .u32(s.ttl_s)
                .done();
            out.extend_from_slice(&w);
        }
        out
    }

    fn from_bytes(bytes: &[u8]) -> Option<Remembered> {
        if bytes.len() != ENCODED_LEN {
            return None;
        }
        let mut r = Remembered::default();
        for (slot, chunk) in r.slots.iter_mut().zip(bytes.chunks_exact(SLOT_LEN)) {
            let mut rd = Reader::exact(chunk, SLOT_LEN)?;
            *slot = Slot {
                hash: rd.u64()?,
                expires_ms: rd.u64()?,
                ttl_s: rd.u32()?,
            };
        }
        Some(r)
    }
}

/// Which of the prompt's candidates the provider is predicted to read from its cache, for
/// (`account`, `model`) now. Read-only: nothing is created for a prompt that was never seen.
pub(crate) fn lookup(env: &Env, account: u64, model: u64, prompt: &Prompt) -> Option<usize> {
    let (bytes, _) = env.store.get(&keys::prefixes_key(account, model)).ok()??;
    Remembered::from_bytes(&bytes)?.hit(&prompt.candidates, env.now())
}

/// The provider answered a request of (`account`, `model`) with success: it has the prompt's
/// breakpoints in its cache now, and renewed the prefix it read. A new (account, model) counts
/// against `max_keys`; past it nothing is remembered (its requests reserve all their input).
pub(crate) fn remember(
    env: &mut Env,
    max_keys: u64,
    pool: usize,
    (account, model): (u64, u64),
    prompt: &Prompt,
    hit: Option<usize>,
) {
    let key = keys::prefixes_key(account, model);
    if !keyspace::key_exists_or_admit(max_keys, &key, keys::BUCKET_KEY_COUNT, pool, env) {
        return;
    }
    let now = env.now();
    let empty = Remembered::default();
    keyspace::modify(
        env,
        pool,
        &key,
        None,
        Some(&empty),
        |r: Option<Remembered>| (Some(r.unwrap_or_default().remember(prompt, hit, now)), ()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::Breakpoint;

    fn prompt(hashes: &[(u64, u64)], marks: &[(u64, u64)]) -> Prompt {
        Prompt {
            candidates: hashes
                .iter()
                .map(|&(hash, uncached)| Candidate { hash, uncached })
                .collect(),
            breakpoints: marks
                .iter()
                .map(|&(hash, ttl_ms)| Breakpoint { hash, ttl_ms })
                .collect(),
        }
    }

    #[test]
    fn a_written_prefix_is_read_until_it_expires_and_each_read_renews_it() {
        let p = prompt(&[(2, 50), (1, 500)], &[(1, 300_000)]);
        let r = Remembered::default().remember(&p, None, 0);
        assert_eq!(r.hit(&p.candidates, 299_999), Some(1));
        assert_eq!(r.hit(&p.candidates, 300_000), None);
        // Read at 200 s: renewed until 500 s.
        let r = r.remember(&prompt(&[(1, 500)], &[]), Some(0), 200_000);
        assert_eq!(r.hit(&p.candidates, 499_999), Some(1));
        assert_eq!(r.hit(&p.candidates, 500_000), None);
        // The longer prefix wins once remembered; an hour's stays an hour.
        let r = r.remember(&prompt(&[], &[(2, 3_600_000)]), None, 0);
        assert_eq!(r.hit(&p.candidates, 1), Some(0));
        assert_eq!(r.hit(&p.candidates, 3_599_999), Some(0));
        let bytes = r.to_bytes();
        assert_eq!(bytes.len(), ENCODED_LEN);
        assert_eq!(Remembered::from_bytes(&bytes), Some(r));
        assert_eq!(Remembered::from_bytes(&bytes[1..]), None);
    }

    #[test]
    fn past_its_slots_the_prefix_expiring_first_is_replaced() {
        let mut r = Remembered::default();
        for h in 1..=(SLOTS as u64 + 5) {
            r = r.remember(&prompt(&[], &[(h, 300_000)]), None, h);
        }
        let live = |h| {
            r.hit(
                &[Candidate {
                    hash: h,
                    uncached: 0,
                }],
                6,
            )
        };
        assert_eq!(live(1), None, "the oldest went first");
        assert_eq!(live(SLOTS as u64 + 5), Some(0));
        assert_eq!(live(6), Some(0));
    }
}
