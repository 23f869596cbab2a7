//! Read-only view over a header list as the host hands it over: lowercase names, raw bytes.

/// A header list. Values are untrusted bytes; names are compared case-insensitively.
#[derive(Clone, Copy)]
pub struct Headers<'a> {
    pairs: &'a [(String, Vec<u8>)],
}

impl<'a> Headers<'a> {
    pub fn new(pairs: &'a [(String, Vec<u8>)]) -> Self {
        Self { pairs }
    }

    /// The first value of `name`. Duplicated headers resolve to the first occurrence, which is
    /// what Envoy's own single-value getters do.
    pub fn get(&self, name: &str) -> Option<&'a [u8]> {
        self.pairs
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// Every value of `name`, in order.
    pub fn all<'n>(&self, name: &'n str) -> impl Iterator<Item = &'a [u8]> + 'n
    where
        'a: 'n,
    {
        self.pairs
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// The first value of `name` as trimmed UTF-8, or None when absent, empty or not UTF-8.
    pub fn get_str(&self, name: &str) -> Option<&'a str> {
        let s = std::str::from_utf8(self.get(name)?).ok()?.trim();
        (!s.is_empty()).then_some(s)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
}

/// Build an owned header list from string pairs (tests and fixtures).
pub fn owned(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_ascii_lowercase(), v.as_bytes().to_vec()))
        .collect()
}
