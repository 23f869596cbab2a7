//! Read-only view over a header list as the host hands it over: lowercase names, raw bytes.
//! Both hosts read headers through this one view (`Headers`), over their own representation.
//!
//! The proxy-wasm host hands a header map over as one buffer in the proxy-wasm wire format;
//! `WireHeaders` keeps that buffer and reads names and values in place, walking its length
//! table: reading headers costs the one allocation the host makes per callback, not two per
//! header. The dynamic-module host lends (name, value) slices into Envoy's own header map
//! (`Headers::borrowed`), read in place with no copy at all. Both keep a 64-bit summary of the
//! names they hold (one bit per name, from its length and first and last bytes): most lookups
//! are for a header the request does not carry, and the summary answers those with one test.

/// A header list. Values are untrusted bytes; names are compared case-insensitively.
#[derive(Clone, Copy)]
pub struct Headers<'a> {
    repr: Repr<'a>,
}

/// A (name, value) pair a host lends.
pub type Pair<'a> = (&'a [u8], &'a [u8]);

#[derive(Clone, Copy)]
enum Repr<'a> {
    Owned(&'a [(String, Vec<u8>)]),
    Wire(&'a WireHeaders),
    /// Slices a host lends for the length of a callback, with the `name_bit` summary.
    Borrowed(&'a [Pair<'a>], u64),
}

impl<'a> Headers<'a> {
    pub fn new(pairs: &'a [(String, Vec<u8>)]) -> Self {
        Self {
            repr: Repr::Owned(pairs),
        }
    }

    pub fn wire(map: &'a WireHeaders) -> Self {
        Self {
            repr: Repr::Wire(map),
        }
    }

    /// A view of (name, value) slices a host lends (the dynamic-module host: pointers into
    /// Envoy's header map, valid for the callback). Names are Envoy's, lowercase.
    pub fn borrowed(pairs: &'a [Pair<'a>]) -> Self {
        let names = pairs.iter().fold(0, |bits, (n, _)| bits | name_bit(n));
        Self {
            repr: Repr::Borrowed(pairs, names),
        }
    }

    /// Every (name, value) pair, in order.
    pub fn pairs(&self) -> impl Iterator<Item = (&'a [u8], &'a [u8])> + 'a {
        let (owned, wire, borrowed): (&'a [(String, Vec<u8>)], _, &'a [Pair<'a>]) = match self.repr
        {
            Repr::Owned(p) => (p, None, &[]),
            Repr::Wire(w) => (&[], Some(w), &[]),
            Repr::Borrowed(b, _) => (&[], None, b),
        };
        owned
            .iter()
            .map(|(n, v)| (n.as_bytes(), v.as_slice()))
            .chain(wire.into_iter().flat_map(WireHeaders::pairs))
            .chain(borrowed.iter().copied())
    }

    /// An owned copy, for a stream that keeps the headers past the callback that lent them.
    pub fn to_wire(&self) -> WireHeaders {
        match self.repr {
            Repr::Wire(w) => w.clone(),
            Repr::Owned(_) | Repr::Borrowed(..) => {
                let pairs: Vec<(&[u8], &[u8])> = self.pairs().collect();
                WireHeaders::parse(WireHeaders::encode(pairs)).unwrap_or_default()
            }
        }
    }

    /// Call `f` with every (name, value) pair, in order (a plain loop per representation, which
    /// costs less than `pairs()`'s chained iterator on the hot path).
    pub fn for_each(&self, mut f: impl FnMut(&'a [u8], &'a [u8])) {
        match self.repr {
            Repr::Owned(pairs) => pairs.iter().for_each(|(n, v)| f(n.as_bytes(), v)),
            Repr::Wire(w) => w.pairs().for_each(|(n, v)| f(n, v)),
            Repr::Borrowed(pairs, _) => pairs.iter().for_each(|(n, v)| f(n, v)),
        }
    }

    /// The first value of `name`. Duplicated headers resolve to the first occurrence, which is
    /// what Envoy's own single-value getters do. (A loop per representation: this is the
    /// hot path's most frequent call.)
    pub fn get(&self, name: &str) -> Option<&'a [u8]> {
        let name = name.as_bytes();
        match self.repr {
            Repr::Owned(pairs) => pairs
                .iter()
                .find(|(n, _)| n.as_bytes().eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_slice()),
            Repr::Wire(w) if w.names & name_bit(name) == 0 => None,
            Repr::Wire(w) => w.pairs().find(|(n, _)| same_name(n, name)).map(|(_, v)| v),
            Repr::Borrowed(_, names) if names & name_bit(name) == 0 => None,
            Repr::Borrowed(pairs, _) => pairs
                .iter()
                .find(|(n, _)| same_name(n, name))
                .map(|(_, v)| *v),
        }
    }

    /// Every value of `name`, in order.
    pub fn all<'n>(&self, name: &'n str) -> impl Iterator<Item = &'a [u8]> + 'n
    where
        'a: 'n,
    {
        self.pairs()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }

    /// The first value of `name` as trimmed UTF-8, or None when absent, empty or not UTF-8.
    pub fn get_str(&self, name: &str) -> Option<&'a str> {
        value_str(self.get(name)?)
    }

    /// A response's `:status` (0 when missing or not a number).
    pub fn status(&self) -> u16 {
        self.get_str(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    /// The `content-length` a request declares (0 when missing or not a number).
    pub fn content_length(&self) -> usize {
        self.get_str("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
}

/// Whether header name `a` is `b` in any case. Exactly first, eight bytes at a time (a slice
/// `==` is a call to a byte loop in wasm), as Envoy hands names over lowercased; the case fold
/// runs, out of line, only for a name that is not.
pub fn same_name(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && (exactly_equal(a, b) || folded_eq(a, b))
}

/// `a == b` for slices of one length, in 8-byte words.
fn exactly_equal(a: &[u8], b: &[u8]) -> bool {
    let word = |c: &[u8]| <[u8; 8]>::try_from(c).map_or(0, u64::from_ne_bytes);
    let (wa, wb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tails_equal = wa
        .remainder()
        .iter()
        .zip(wb.remainder())
        .all(|(x, y)| x == y);
    tails_equal && wa.zip(wb).all(|(x, y)| word(x) == word(y))
}

#[inline(never)]
fn folded_eq(a: &[u8], b: &[u8]) -> bool {
    a.eq_ignore_ascii_case(b)
}

/// A header value as UTF-8 without its surrounding whitespace (HTTP's: spaces and tabs, and
/// the other ASCII whitespace), or None when empty or not UTF-8.
pub fn value_str(v: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(v.trim_ascii()).ok()?;
    (!s.is_empty()).then_some(s)
}

/// Build an owned header list from string pairs (tests and fixtures).
pub fn owned(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_ascii_lowercase(), v.as_bytes().to_vec()))
        .collect()
}

/// One of 64 bits for a header name, the same for a name in any case: from its length and its
/// first and last bytes (`| 0x20` folds ASCII case; it also folds a few punctuation pairs
/// together, which costs only a scan).
fn name_bit(name: &[u8]) -> u64 {
    let fold = |b: Option<&u8>| u32::from(b.copied().unwrap_or(0) | 0x20);
    let h = (name.len() as u32 ^ fold(name.first()) << 8 ^ fold(name.last()) << 16)
        .wrapping_mul(0x9e37_79b1);
    1 << (h >> 26)
}

/// A header map in the proxy-wasm wire format: a count, then (name length, value length) pairs,
/// then each name and value followed by a NUL. Checked once by `parse`; read by walking the
/// length table (every read is in order, so no offsets are kept).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WireHeaders {
    bytes: Vec<u8>,
    /// Where the names and values start (past the length table).
    data_at: usize,
    /// The `name_bit` of every name, or-ed: a name whose bit is clear is not here.
    names: u64,
}

/// The (name length, value length) of one entry of the length table.
fn lengths(e: &[u8; 8]) -> (usize, usize) {
    let le = |i: usize| u32::from_le_bytes([e[i], e[i + 1], e[i + 2], e[i + 3]]) as usize;
    (le(0), le(4))
}

impl WireHeaders {
    /// Parse the host's buffer; None when it is malformed (never a panic).
    pub fn parse(bytes: Vec<u8>) -> Option<WireHeaders> {
        if bytes.is_empty() {
            return Some(WireHeaders::default());
        }
        let count = u32::from_le_bytes(*bytes.first_chunk::<4>()?) as usize;
        let data_at = 4usize.checked_add(count.checked_mul(8)?)?;
        if data_at > bytes.len() {
            return None;
        }
        let mut p = data_at;
        let mut names = 0;
        for entry in bytes[4..data_at].chunks_exact(8) {
            let (name_len, value_len) = lengths(entry.try_into().ok()?);
            let name_at = p;
            p = name_at
                .checked_add(name_len)?
                .checked_add(value_len)?
                .checked_add(2)?;
            if p > bytes.len() {
                return None;
            }
            names |= name_bit(&bytes[name_at..name_at + name_len]);
        }
        Some(WireHeaders {
            bytes,
            data_at,
            names,
        })
    }

    pub fn pairs(&self) -> Entries<'_> {
        Entries {
            bytes: &self.bytes,
            table: self
                .bytes
                .get(4..self.data_at)
                .unwrap_or(&[])
                .chunks_exact(8),
            at: self.data_at,
        }
    }

    /// Encode pairs in the wire format (the inverse of `parse`): the proxy-wasm host's local
    /// replies, owned copies of other header lists, tests.
    pub fn encode<'p>(pairs: impl IntoIterator<Item = (&'p [u8], &'p [u8])> + Clone) -> Vec<u8> {
        let items: Vec<(&[u8], &[u8])> = pairs.into_iter().collect();
        let mut out = Vec::new();
        out.extend_from_slice(&(items.len() as u32).to_le_bytes());
        for (k, v) in &items {
            out.extend_from_slice(&(k.len() as u32).to_le_bytes());
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        for (k, v) in &items {
            out.extend_from_slice(k);
            out.push(0);
            out.extend_from_slice(v);
            out.push(0);
        }
        out
    }
}

/// The (name, value) pairs of a `WireHeaders`, in order, read off its length table.
pub struct Entries<'a> {
    bytes: &'a [u8],
    table: std::slice::ChunksExact<'a, u8>,
    at: usize,
}

impl<'a> Iterator for Entries<'a> {
    type Item = (&'a [u8], &'a [u8]);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let (name_len, value_len) = lengths(self.table.next()?.try_into().ok()?);
        // `parse` checked that every name and value fits the buffer.
        let value_at = self.at + name_len + 1;
        let name = self.bytes.get(self.at..value_at - 1)?;
        let value = self.bytes.get(value_at..value_at + value_len)?;
        self.at = value_at + value_len + 1;
        Some((name, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_round_trips_and_reads_like_owned_pairs() {
        let owned = owned(&[
            (":status", "429"),
            ("retry-after", "3"),
            ("Retry-After", "9"),
        ]);
        let bytes = WireHeaders::encode(owned.iter().map(|(n, v)| (n.as_bytes(), v.as_slice())));
        let wire = WireHeaders::parse(bytes).expect("well-formed");
        let (a, b) = (Headers::new(&owned), Headers::wire(&wire));
        assert_eq!(a.pairs().collect::<Vec<_>>(), b.pairs().collect::<Vec<_>>());
        assert_eq!(b.get("RETRY-AFTER"), Some(&b"3"[..]));
        assert_eq!(b.all("retry-after").count(), 2);
        assert_eq!(WireHeaders::parse(Vec::new()), Some(WireHeaders::default()));
        let lent: Vec<(&[u8], &[u8])> = a.pairs().collect();
        let c = Headers::borrowed(&lent);
        assert_eq!(a.pairs().collect::<Vec<_>>(), c.pairs().collect::<Vec<_>>());
        assert_eq!(c.get("RETRY-AFTER"), Some(&b"3"[..]));
        assert_eq!(c.get("x-absent"), None);
        assert_eq!(c.to_wire(), b.to_wire());
    }

    #[test]
    fn lookups_find_the_first_pair_of_the_name_in_any_case_and_nothing_else() {
        let names = [
            "a",
            "ab",
            "x-api-k",
            "x-api-ke",
            "x-api-key",
            "x-api-kez",
            "X-Api-Keys",
            "authorization",
            "AUTHORIZATIOn",
            "authorizatioN-x",
            "",
            "B",
        ];
        let owned: Vec<(String, Vec<u8>)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), i.to_string().into_bytes()))
            .collect();
        let bytes = WireHeaders::encode(owned.iter().map(|(n, v)| (n.as_bytes(), v.as_slice())));
        let wire = WireHeaders::parse(bytes).expect("well-formed");
        let probes = [
            "x-api",
            "authorization-",
            "b",
            "X-API-KEY",
            "c",
            "x-tenant-id",
            "x-api-kex",
        ];
        for probe in names.iter().chain(&probes) {
            // The first pair whose name equals the probe in any case, by a plain byte loop.
            let expected = owned
                .iter()
                .find(|(n, _)| n.as_bytes().eq_ignore_ascii_case(probe.as_bytes()))
                .map(|(_, v)| v.as_slice());
            assert_eq!(Headers::wire(&wire).get(probe), expected, "{probe:?}");
        }
        // The summary tells apart most names a request lacks (it cannot be exact: 64 bits).
        let lacking = [
            "x-stainless-timeout",
            "x-api-key",
            "api-key",
            "x-stainless-retry-count",
            "anthropic-version",
            "x-llm-governor-pool",
            "x-goog-api-key",
        ];
        let one =
            WireHeaders::parse(WireHeaders::encode([(&b"authorization"[..], &b"k"[..])])).unwrap();
        assert!(
            lacking
                .iter()
                .filter(|n| one.names & name_bit(n.as_bytes()) == 0)
                .count()
                >= 6
        );
    }

    #[test]
    fn names_compare_like_a_case_fold() {
        let names = [
            "",
            "a",
            "A",
            "b",
            "x-ratelimit-",
            "X-RateLimit-",
            "x-ratelimit-limit-requests",
            "x-ratelimit-limit-requestS",
            "x-ratelimit-limit-requestt",
            "authorization",
            "authorizatioN",
            "authorizatio",
            "abcdefgh",
            "abcdefgH",
            "abcdefgi",
            "abcdefghi",
        ];
        for a in names {
            for b in names {
                let (a, b) = (a.as_bytes(), b.as_bytes());
                assert_eq!(same_name(a, b), a.eq_ignore_ascii_case(b), "{a:?} {b:?}");
            }
        }
    }

    #[test]
    fn malformed_wire_buffers_are_refused() {
        let good = WireHeaders::encode([(&b"a"[..], &b"b"[..])]);
        for cut in 1..good.len() {
            assert_eq!(
                WireHeaders::parse(good[..cut].to_vec()),
                None,
                "cut at {cut}"
            );
        }
        assert_eq!(WireHeaders::parse(vec![255, 255, 255, 255]), None);
        let mut huge = good.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(WireHeaders::parse(huge), None);
    }
}
