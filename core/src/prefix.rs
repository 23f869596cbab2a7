//! Anthropic's prompt-cache breakpoints, read from a request body as keyed hashes of the
//! prompt's prefixes: what lets the filter predict which part of a prompt the provider will
//! read from its cache (and not count against its input-token limit) before the call.
//!
//! The provider's cache works on prefixes in a fixed order: `tools`, then `system`, then
//! `messages`, whatever order the body's keys come in. A `cache_control` on a block marks a
//! breakpoint: the prompt up to the end of that block is written to the cache (5 minutes,
//! renewed on every read; an hour with `"ttl": "1h"`), and a later request whose prompt has a
//! remembered prefix at one of the 20 block boundaries before one of its own breakpoints reads
//! that prefix from the cache. So the prompt is cut into blocks (each tool, each system block,
//! each message's content blocks) and the prefix at every boundary is one chained keyed hash
//! (`keys::HashKey`): the same bytes in the same places give the same hash, and nothing of the
//! content is kept. Only the hashes and the estimated tokens after each boundary leave here.
//!
//! Bad input is estimated, never refused: a body that is not JSON or has no breakpoint gives
//! None; `cache_control` anywhere but on a block (or a message) is ignored; an unknown `ttl` is
//! taken as 5 minutes (the shorter: a read predicted too rarely only reserves more); a body cut
//! at the read limit gives the boundaries before the cut.

use crate::estimate;
use crate::keys::HashKey;

/// Anthropic accepts 4 breakpoints; more than this many are not looked at.
pub const MAX_BREAKPOINTS: usize = 8;
/// How many block boundaries before a breakpoint the provider looks for a cached prefix at.
pub const LOOKBACK: usize = 20;
/// Boundaries followed at most (a prompt of more blocks is hashed up to here).
const MAX_BOUNDARIES: usize = 4096;
/// The cache's lifetimes: 5 minutes unless a block says `"ttl": "1h"`.
pub const FIVE_MINUTES_MS: u64 = 5 * 60_000;
pub const ONE_HOUR_MS: u64 = 60 * 60_000;

/// The prefix up to a breakpoint, to remember once the provider has answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Breakpoint {
    pub hash: u64,
    pub ttl_ms: u64,
}

/// A boundary a cache hit may be found at: the prefix's hash, and the input tokens the prompt
/// has after it (what the provider counts if that prefix is read from its cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub hash: u64,
    pub uncached: u64,
}

/// What a request's body says of the provider's prompt cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prompt {
    /// Boundaries within `LOOKBACK` blocks before a breakpoint, the longest prefix first.
    pub candidates: Vec<Candidate>,
    pub breakpoints: Vec<Breakpoint>,
}

/// The breakpoints of a body (the first `estimate::MAX_BODY` bytes of it) whose whole input
/// is estimated at `input` tokens. None when it marks none, or is not a JSON object.
pub fn scan(body: &[u8], input: u64, key: &HashKey) -> Option<Prompt> {
    let body = &body[..body.len().min(estimate::MAX_BODY)];
    memchr::memmem::find(body, b"\"cache_control\"")?;
    let sections = Sections::of(body)?;
    let mut walk = Walk {
        body,
        key,
        hash: key.id(b"anthropic-prompt"),
        from: 0,
        tokens: 0,
        bounds: Vec::new(),
        marks: Vec::new(),
    };
    for (name, range) in sections.in_cache_order() {
        let Some((start, end)) = range else {
            continue;
        };
        walk.hash = key.mix(walk.hash, key.id(name));
        walk.from = start;
        let done = match name {
            b"messages" => walk.messages(start, end),
            _ => walk.blocks(start, end),
        };
        if !done {
            break;
        }
    }
    walk.prompt(input)
}

/// Where the three sections' values are in the body (None: absent). A section cut by the end
/// of what was read, or absent from a body that was cut before its end, stops the walk there:
/// what comes after it in cache order is unknown.
struct Sections {
    found: [Option<(usize, usize)>; 3],
    /// The index in cache order past which nothing is known.
    known: usize,
}

const NAMES: [&[u8]; 3] = [b"tools", b"system", b"messages"];

impl Sections {
    fn of(b: &[u8]) -> Option<Sections> {
        let start = skip_ws(b, 0);
        if b.get(start) != Some(&b'{') {
            return None;
        }
        let mut found = [None; 3];
        let mut cut_at = None;
        let mut complete = false;
        for member in Members::new(b, start) {
            match member {
                Member::Pair { key, value } => {
                    if let Some(i) = NAMES.iter().position(|n| *n == key) {
                        found[i].get_or_insert(value);
                    }
                }
                Member::Cut { key } => {
                    cut_at = NAMES.iter().position(|n| *n == key);
                    break;
                }
                Member::End => complete = true,
            }
        }
        // Past a cut section nothing is known; with the body cut elsewhere, up to the first
        // section not found.
        // A cut section is unknown, and so is any section before it not found yet: it may
        // come later in the body.
        let missing = found
            .iter()
            .position(Option::is_none)
            .unwrap_or(NAMES.len());
        let known = match (cut_at, complete) {
            (Some(i), _) => i.min(missing),
            (None, true) => NAMES.len(),
            (None, false) => missing,
        };
        Some(Sections { found, known })
    }

    fn in_cache_order(&self) -> impl Iterator<Item = (&'static [u8], Option<(usize, usize)>)> + '_ {
        NAMES
            .iter()
            .zip(self.found)
            .take(self.known)
            .map(|(n, r)| (*n, r))
    }
}

/// The prompt being cut into blocks, in cache order.
struct Walk<'a> {
    body: &'a [u8],
    key: &'a HashKey,
    /// The chained hash of the prompt up to `from`.
    hash: u64,
    /// Where the next block's bytes start (the end of the last one, or its section's start).
    from: usize,
    /// Estimated tokens up to `from`.
    tokens: u64,
    /// Every boundary so far: (hash of the prefix, tokens up to it).
    bounds: Vec<(u64, u64)>,
    /// Breakpoints: (index into `bounds`, ttl).
    marks: Vec<(usize, u64)>,
}

impl Walk<'_> {
    /// A block ends at `end`; `mark` is its `cache_control` (ttl, and the bytes of the member)
    /// when it has one. The member itself is not part of the prompt: a client moves its
    /// breakpoint to the newest block each turn, and the provider still reads the older
    /// prefix. False when no more boundaries are followed.
    fn boundary(&mut self, end: usize, mark: Option<Mark>) -> bool {
        let whole = &self.body[self.from..end];
        let cut;
        let segment = match mark {
            Some(Mark { member: (s, e), .. }) if self.from <= s && e <= end => {
                cut = [&self.body[self.from..s], &self.body[e..end]].concat();
                &cut[..]
            }
            _ => whole,
        };
        self.hash = self.key.mix(self.hash, self.key.id(segment));
        self.tokens = self
            .tokens
            .saturating_add(estimate::fragment_tokens(segment));
        let mark = mark.map(|m| m.ttl_ms);
        self.from = end;
        self.bounds.push((self.hash, self.tokens));
        if let Some(ttl) = mark {
            if self.marks.len() < MAX_BREAKPOINTS {
                self.marks.push((self.bounds.len() - 1, ttl));
            }
        }
        self.bounds.len() < MAX_BOUNDARIES
    }

    /// `tools` or `system`: an array of blocks, or (system) a string, one block without a
    /// breakpoint. False when the walk stops.
    fn blocks(&mut self, start: usize, end: usize) -> bool {
        match self.body[start] {
            b'[' => {
                for el in Elements::new(self.body, start) {
                    let Some((s, e)) = el else { return false };
                    let mark = breakpoint_of(self.body, s);
                    if !self.boundary(e, mark) {
                        return false;
                    }
                }
                true
            }
            _ => self.boundary(end, None),
        }
    }

    /// `messages`: each message's content blocks (a string content is one block); a
    /// `cache_control` on the message itself marks its end.
    fn messages(&mut self, start: usize, _end: usize) -> bool {
        if self.body[start] != b'[' {
            return true;
        }
        for msg in Elements::new(self.body, start) {
            let Some((s, e)) = msg else { return false };
            if self.body[s] != b'{' {
                continue;
            }
            let mut content = None;
            for member in Members::new(self.body, s) {
                match member {
                    Member::Pair { key, value } if key == b"content" => content = Some(value),
                    Member::Cut { .. } => return false,
                    _ => {}
                }
            }
            let own_mark = breakpoint_of(self.body, s);
            match content {
                Some((cs, _)) if self.body[cs] == b'[' => {
                    let mut last = None;
                    for el in Elements::new(self.body, cs) {
                        let Some((bs, be)) = el else { return false };
                        let mark = breakpoint_of(self.body, bs);
                        if !self.boundary(be, mark) {
                            return false;
                        }
                        last = Some(self.bounds.len() - 1);
                    }
                    if let (Some(m), Some(i)) = (own_mark, last) {
                        if self.marks.len() < MAX_BREAKPOINTS {
                            self.marks.push((i, m.ttl_ms));
                        }
                    }
                }
                _ => {
                    if !self.boundary(e, own_mark) {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// The candidates and breakpoints found, for a prompt of `input` tokens in all.
    fn prompt(self, input: u64) -> Option<Prompt> {
        if self.marks.is_empty() {
            return None;
        }
        let mut picked = vec![false; self.bounds.len()];
        for &(at, _) in &self.marks {
            for p in &mut picked[at.saturating_sub(LOOKBACK)..=at] {
                *p = true;
            }
        }
        let candidates = (0..self.bounds.len())
            .rev()
            .filter(|&i| picked[i])
            .map(|i| Candidate {
                hash: self.bounds[i].0,
                uncached: input.saturating_sub(self.bounds[i].1),
            })
            .collect();
        let breakpoints = self
            .marks
            .iter()
            .map(|&(at, ttl_ms)| Breakpoint {
                hash: self.bounds[at].0,
                ttl_ms,
            })
            .collect();
        Some(Prompt {
            candidates,
            breakpoints,
        })
    }
}

/// A block's `cache_control`: the lifetime it asks for, and the bytes of the member (with the
/// comma that joins it to its neighbours).
#[derive(Clone, Copy)]
struct Mark {
    ttl_ms: u64,
    member: (usize, usize),
}

/// The `cache_control` of the block (an object starting at `start`), when it has one:
/// `"ttl": "1h"` an hour, anything else 5 minutes.
fn breakpoint_of(b: &[u8], start: usize) -> Option<Mark> {
    if b.get(start) != Some(&b'{') {
        return None;
    }
    let (ks, (cs, ce)) = Members::new(b, start).find_map(|m| match m {
        Member::Pair { key, value } if key == b"cache_control" => {
            // The key's opening quote: just before the key's bytes.
            let ks = key.as_ptr() as usize - b.as_ptr() as usize - 1;
            Some((ks, value))
        }
        _ => None,
    })?;
    if b[cs] != b'{' {
        return None; // `"cache_control": null` and the like mark nothing
    }
    let ttl = Members::new(b, cs).find_map(|m| match m {
        Member::Pair { key, value } if key == b"ttl" => Some(&b[value.0..value.1]),
        _ => None,
    });
    // With the comma before it, or (first member) the one after it.
    let before = b[..ks].iter().rposition(|c| !c.is_ascii_whitespace());
    let after = skip_ws(b, ce);
    let member = match (before.map(|i| b[i]), b.get(after)) {
        (Some(b','), _) => (before.unwrap_or(ks), ce),
        (_, Some(b',')) => (ks, skip_ws(b, after + 1)),
        _ => (ks, ce),
    };
    Some(Mark {
        ttl_ms: match ttl {
            Some(b"\"1h\"") => ONE_HOUR_MS,
            _ => FIVE_MINUTES_MS,
        },
        member,
    })
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The end (exclusive) of the JSON value starting at `i`, or None when the bytes end first or
/// it is not a value. Containers are skipped by counting brackets outside strings, however deep.
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match *b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        c if c == b'-' || c.is_ascii_alphanumeric() => {
            let n = b[i..]
                .iter()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'+' | b'.'))
                .count();
            // A literal running into the end of what was read may go on past it.
            (i + n < b.len()).then_some(i + n)
        }
        _ => None,
    }
}

/// The end (exclusive, past the closing quote) of the string whose opening quote is at `i`.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        let off = memchr::memchr2(b'"', b'\\', b.get(j..)?)?;
        j += off;
        if b[j] == b'"' {
            return Some(j + 1);
        }
        j += 2;
    }
}

/// One member of an object, as `Members` reads it.
enum Member<'a> {
    /// `key` (without quotes, escapes as written) and its value's range.
    Pair {
        key: &'a [u8],
        value: (usize, usize),
    },
    /// The bytes end (or stop making sense) inside the value of `key` (empty: before a key).
    Cut { key: &'a [u8] },
    /// The object closed.
    End,
}

/// The members of the object whose `{` is at `start`, in order.
struct Members<'a> {
    b: &'a [u8],
    i: usize,
    done: bool,
}

impl<'a> Members<'a> {
    fn new(b: &'a [u8], start: usize) -> Members<'a> {
        Members {
            b,
            i: start + 1,
            done: false,
        }
    }
}

impl<'a> Iterator for Members<'a> {
    type Item = Member<'a>;

    fn next(&mut self) -> Option<Member<'a>> {
        if self.done {
            return None;
        }
        let b = self.b;
        let mut i = skip_ws(b, self.i);
        if b.get(i) == Some(&b',') {
            i = skip_ws(b, i + 1);
        }
        let cut = |m: &mut Self, key| {
            m.done = true;
            Some(Member::Cut { key })
        };
        match b.get(i) {
            Some(b'}') => {
                self.done = true;
                return Some(Member::End);
            }
            Some(b'"') => {}
            _ => return cut(self, b""),
        }
        let Some(key_end) = string_end(b, i) else {
            return cut(self, b"");
        };
        let key = &b[i + 1..key_end - 1];
        let colon = skip_ws(b, key_end);
        if b.get(colon) != Some(&b':') {
            return cut(self, key);
        }
        let vs = skip_ws(b, colon + 1);
        let Some(ve) = value_end(b, vs) else {
            return cut(self, key);
        };
        self.i = ve;
        Some(Member::Pair {
            key,
            value: (vs, ve),
        })
    }
}

/// The elements of the array whose `[` is at `start`: each one's range, or None once the
/// bytes end (or stop making sense) inside it.
struct Elements<'a> {
    b: &'a [u8],
    i: usize,
    done: bool,
}

impl<'a> Elements<'a> {
    fn new(b: &'a [u8], start: usize) -> Elements<'a> {
        Elements {
            b,
            i: start + 1,
            done: false,
        }
    }
}

impl Iterator for Elements<'_> {
    type Item = Option<(usize, usize)>;

    fn next(&mut self) -> Option<Option<(usize, usize)>> {
        if self.done {
            return None;
        }
        let mut i = skip_ws(self.b, self.i);
        if self.b.get(i) == Some(&b',') {
            i = skip_ws(self.b, i + 1);
        }
        if self.b.get(i) == Some(&b']') {
            self.done = true;
            return None;
        }
        match value_end(self.b, i) {
            Some(e) => {
                self.i = e;
                Some(Some((i, e)))
            }
            None => {
                self.done = true;
                Some(None)
            }
        }
    }
}
