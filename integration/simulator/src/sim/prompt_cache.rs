//! Anthropic's prompt cache, as its documentation describes it: a `cache_control` on a block
//! marks a breakpoint; the prompt up to it (tools, then system, then messages, whatever order
//! the body's keys come in) is written to the cache for 5 minutes (an hour with
//! `"ttl": "1h"`), renewed on every read; a request reads the longest cached prefix found at
//! one of the 20 block boundaries before one of its breakpoints. The answer's usage then
//! reports `cache_read_input_tokens` (that prefix), `cache_creation_input_tokens` (from there
//! to the last breakpoint) and `input_tokens` (the rest). A block's tokens are its JSON's
//! bytes / 4, the simulator's own count, independent of any gateway's; its `cache_control`
//! member is not part of it (a client moves its breakpoint to the newest block each turn).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::Value;

const LOOKBACK: usize = 20;
const FIVE_MINUTES: Duration = Duration::from_secs(300);
const ONE_HOUR: Duration = Duration::from_secs(3600);
/// Entries kept at most (the oldest-expiring go first past it).
const MAX_ENTRIES: usize = 100_000;

/// A prompt cut into blocks: the prefix hash and the tokens up to each block's end, and the
/// breakpoints (index, lifetime).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt {
    bounds: Vec<(u64, u64)>,
    marks: Vec<(usize, Duration)>,
}

fn fnv(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Prompt {
    /// The blocks of an Anthropic request body (None: it marks no breakpoint).
    pub fn of(body: &Value) -> Option<Prompt> {
        let mut p = Prompt::default();
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut tokens = 0u64;
        let mut block = |p: &mut Prompt, v: &Value, h: &mut u64| {
            let mut v = v.clone();
            let ttl = v
                .as_object_mut()
                .and_then(|o| o.remove("cache_control"))
                .and_then(|cc| {
                    cc.is_object()
                        .then(|| match cc.get("ttl").and_then(Value::as_str) {
                            Some("1h") => ONE_HOUR,
                            _ => FIVE_MINUTES,
                        })
                });
            let bytes = v.to_string().into_bytes();
            *h = fnv(*h, &bytes);
            tokens += (bytes.len() as u64).div_ceil(4);
            p.bounds.push((*h, tokens));
            if let Some(ttl) = ttl {
                p.marks.push((p.bounds.len() - 1, ttl));
            }
        };
        for section in ["tools", "system", "messages"] {
            h = fnv(h, section.as_bytes());
            match body.get(section) {
                Some(Value::Array(items)) if section == "messages" => {
                    for m in items {
                        h = fnv(
                            h,
                            m.get("role")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .as_bytes(),
                        );
                        match m.get("content") {
                            Some(Value::Array(blocks)) => {
                                blocks.iter().for_each(|b| block(&mut p, b, &mut h))
                            }
                            Some(other) => block(&mut p, other, &mut h),
                            None => {}
                        }
                    }
                }
                Some(Value::Array(items)) => items.iter().for_each(|b| block(&mut p, b, &mut h)),
                Some(other) => block(&mut p, other, &mut h),
                None => {}
            }
        }
        (!p.marks.is_empty()).then_some(p)
    }
}

/// What the cache makes of one request, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUse {
    pub read: u64,
    pub written: u64,
    /// The prefix read (its hash), renewed when the request is served.
    hit: Option<u64>,
}

/// Every (account, model, prefix) in the cache, until when.
#[derive(Default)]
pub struct PromptCache(HashMap<(String, String, u64), (Instant, Duration)>);

impl PromptCache {
    /// What the request would read and write now (nothing changes until `serve`).
    pub fn look(&self, key: &str, model: &str, p: &Prompt, now: Instant) -> CacheUse {
        let live = |h: u64| {
            self.0
                .get(&(key.to_string(), model.to_string(), h))
                .is_some_and(|(until, _)| *until > now)
        };
        let hit = p
            .marks
            .iter()
            .flat_map(|&(at, _)| at.saturating_sub(LOOKBACK)..=at)
            .filter(|&i| live(p.bounds[i].0))
            .max();
        let read = hit.map_or(0, |i| p.bounds[i].1);
        let last = p.marks.iter().map(|&(at, _)| at).max().unwrap_or(0);
        let written = p.bounds[last].1.saturating_sub(read);
        CacheUse {
            read,
            written: if hit.is_some_and(|i| i >= last) {
                0
            } else {
                written
            },
            hit: hit.map(|i| p.bounds[i].0),
        }
    }

    /// The request was served: its breakpoints are written, the prefix it read renewed.
    pub fn serve(&mut self, key: &str, model: &str, p: &Prompt, used: &CacheUse, now: Instant) {
        if self.0.len() >= MAX_ENTRIES {
            self.0.retain(|_, (until, _)| *until > now);
        }
        let k = |h| (key.to_string(), model.to_string(), h);
        if let Some(h) = used.hit {
            if let Some((until, ttl)) = self.0.get_mut(&k(h)) {
                *until = (*until).max(now + *ttl);
            }
        }
        for &(at, ttl) in &p.marks {
            let e = self.0.entry(k(p.bounds[at].0)).or_insert((now, ttl));
            *e = (e.0.max(now + ttl), e.1.max(ttl));
        }
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(turns: usize) -> Value {
        let messages: Vec<Value> = (0..turns)
            .map(|i| {
                let mut b =
                    json!({"type": "text", "text": format!("turn {i} {}", "x".repeat(396))});
                if i + 1 == turns {
                    b["cache_control"] = json!({"type": "ephemeral"});
                }
                json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": [b]})
            })
            .collect();
        json!({"model": "m", "max_tokens": 16000, "messages": messages,
               "system": [{"type": "text", "text": "s".repeat(40_000), "cache_control": {"type": "ephemeral"}}]})
    }

    #[test]
    fn writes_then_reads_and_the_next_turn_reads_the_last() {
        let mut c = PromptCache::default();
        let t0 = Instant::now();
        let one = Prompt::of(&body(1)).unwrap();
        let u = c.look("k", "m", &one, t0);
        assert_eq!(u.read, 0);
        assert!(u.written > 10_000, "{u:?}");
        c.serve("k", "m", &one, &u, t0);
        // The same prompt again: all of it read, nothing written.
        let again = c.look("k", "m", &one, t0);
        assert_eq!((again.read, again.written), (u.written, 0));
        // The third turn reads up to the first turn's breakpoint, writes the two new turns.
        let three = Prompt::of(&body(3)).unwrap();
        let u3 = c.look("k", "m", &three, t0);
        assert_eq!(u3.read, u.written);
        assert!((200..=260).contains(&u3.written), "{u3:?}");
        // Another account, or after 5 minutes: nothing cached.
        assert_eq!(c.look("j", "m", &one, t0).read, 0);
        assert_eq!(c.look("k", "m", &one, t0 + FIVE_MINUTES).read, 0);
        assert_eq!(
            Prompt::of(&json!({"messages": [{"role": "user", "content": "hi"}]})),
            None
        );
    }
}
