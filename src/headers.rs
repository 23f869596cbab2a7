//! Read-only view over a header list as the host hands it over: lowercase names, raw bytes.
//!
//! The host hands a header map over as one buffer in the proxy-wasm wire format; `WireHeaders`
//! keeps that buffer and the offsets of each name and value, so reading headers costs two
//! allocations per callback instead of two per header.

use std::ops::Range;

/// A header list. Values are untrusted bytes; names are compared case-insensitively.
#[derive(Clone, Copy)]
pub struct Headers<'a> {
    repr: Repr<'a>,
}

#[derive(Clone, Copy)]
enum Repr<'a> {
    Owned(&'a [(String, Vec<u8>)]),
    Wire(&'a WireHeaders),
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

    /// Every (name, value) pair, in order.
    pub fn pairs(&self) -> impl Iterator<Item = (&'a [u8], &'a [u8])> + 'a {
        let (owned, wire): (&'a [(String, Vec<u8>)], Option<&'a WireHeaders>) = match self.repr {
            Repr::Owned(p) => (p, None),
            Repr::Wire(w) => (&[], Some(w)),
        };
        owned
            .iter()
            .map(|(n, v)| (n.as_bytes(), v.as_slice()))
            .chain(wire.into_iter().flat_map(WireHeaders::pairs))
    }

    /// Call `f` with every (name, value) pair, in order (a plain loop per representation, which
    /// costs less than `pairs()`'s chained iterator on the hot path).
    pub fn for_each(&self, mut f: impl FnMut(&'a [u8], &'a [u8])) {
        match self.repr {
            Repr::Owned(pairs) => pairs.iter().for_each(|(n, v)| f(n.as_bytes(), v)),
            Repr::Wire(w) => w
                .spans
                .iter()
                .for_each(|(n, v)| f(&w.bytes[n.clone()], &w.bytes[v.clone()])),
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
            Repr::Wire(w) => w
                .spans
                .iter()
                .find(|(n, _)| w.bytes[n.clone()].eq_ignore_ascii_case(name))
                .map(|(_, v)| &w.bytes[v.clone()]),
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

    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
}

/// A header value as trimmed UTF-8, or None when empty or not UTF-8.
pub fn value_str(v: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(v).ok()?.trim();
    (!s.is_empty()).then_some(s)
}

/// Build an owned header list from string pairs (tests and fixtures).
pub fn owned(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_ascii_lowercase(), v.as_bytes().to_vec()))
        .collect()
}

/// A header map in the proxy-wasm wire format: a count, then (name length, value length) pairs,
/// then each name and value followed by a NUL.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WireHeaders {
    bytes: Vec<u8>,
    spans: Vec<(Range<usize>, Range<usize>)>,
}

impl WireHeaders {
    /// Parse the host's buffer; None when it is malformed (never a panic).
    pub fn parse(bytes: Vec<u8>) -> Option<WireHeaders> {
        if bytes.is_empty() {
            return Some(WireHeaders::default());
        }
        let u32_at = |at: usize| -> Option<usize> {
            let b = bytes.get(at..at.checked_add(4)?)?;
            Some(u32::from_le_bytes(b.try_into().ok()?) as usize)
        };
        let count = u32_at(0)?;
        let mut p = 4usize.checked_add(count.checked_mul(8)?)?;
        if p > bytes.len() {
            return None;
        }
        let mut spans = Vec::with_capacity(count);
        for n in 0..count {
            let name_len = u32_at(4 + n * 8)?;
            let value_len = u32_at(8 + n * 8)?;
            let name = p..p.checked_add(name_len)?;
            p = name.end.checked_add(1)?;
            let value = p..p.checked_add(value_len)?;
            p = value.end.checked_add(1)?;
            if p > bytes.len() {
                return None;
            }
            spans.push((name, value));
        }
        Some(WireHeaders { bytes, spans })
    }

    pub fn pairs(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.spans
            .iter()
            .map(|(n, v)| (&self.bytes[n.clone()], &self.bytes[v.clone()]))
    }

    /// Encode pairs in the wire format (the inverse of `parse`; tests and the host's replies).
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
