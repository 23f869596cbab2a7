//! How fuzz inputs become what the host hands the pure core.
//!
//! The header-driven targets read an HTTP-like text, so seeds stay readable and libFuzzer's
//! mutations stay meaningful:
//!
//! ```text
//! retry-after: 7\n          one header per line; the value is raw bytes (any but \n)
//! :now: 1796055600000\n     pseudo-headers set what the host would otherwise supply
//! \n                        a blank line ends the headers
//! {"error": ...}            everything after it is the body
//! ```
//!
//! Names are lowercased, as Envoy hands them over; values are kept byte for byte (including
//! `\r`, NUL and invalid UTF-8), which is exactly what a hostile upstream can send.

/// The clock of the test tables: 2026-11-30T16:20:00Z, so the Anthropic resets and HTTP dates
/// in the seeds lie a few seconds in the future.
pub const T0: u64 = 1_796_055_600_000;

/// An input split into its header list and body.
pub struct Http<'a> {
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: &'a [u8],
}

impl<'a> Http<'a> {
    pub fn parse(data: &'a [u8]) -> Http<'a> {
        let mut headers = Vec::new();
        let mut rest = data;
        loop {
            let (line, next) = match rest.iter().position(|b| *b == b'\n') {
                Some(i) => (&rest[..i], &rest[i + 1..]),
                None => (rest, &rest[rest.len()..]),
            };
            rest = next;
            if line.is_empty() {
                break;
            }
            // A leading ':' belongs to a pseudo-header's name, not its separator.
            let sep = line.iter().skip(1).position(|b| *b == b':').map(|i| i + 1);
            let (name, value) = match sep {
                Some(i) => {
                    let v = &line[i + 1..];
                    (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
                }
                None => (line, &line[line.len()..]),
            };
            headers.push((
                String::from_utf8_lossy(name).to_ascii_lowercase(),
                value.to_vec(),
            ));
            if rest.is_empty() {
                break;
            }
        }
        Http {
            headers,
            body: rest,
        }
    }

    /// A pseudo-header's value as text.
    pub fn pseudo(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .map(str::trim)
    }

    /// A numeric pseudo-header, or `default` when absent or not a number.
    pub fn pseudo_u64(&self, name: &str, default: u64) -> u64 {
        self.pseudo(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }

    /// `:now`, else `T0`.
    pub fn now_ms(&self) -> u64 {
        self.pseudo_u64(":now", T0)
    }

    /// `:rng` as a fraction in [0, 1): the value the host would draw from getrandom.
    pub fn unit(&self) -> f64 {
        (self.pseudo_u64(":rng", 0) % 1_000_000) as f64 / 1_000_000.0
    }
}

/// Fixed randomness for `retry_after::told` and friends.
pub struct Fixed(pub f64);

impl llm_governor_core::retry_after::Random for Fixed {
    fn unit(&mut self) -> f64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_then_body() {
        let h = Http::parse(b"Retry-After: 7\n:now: 5\nx:\xff\r\n\n{\"a\":1}\n");
        assert_eq!(h.headers[0], ("retry-after".to_string(), b"7".to_vec()));
        assert_eq!(h.now_ms(), 5);
        assert_eq!(h.headers[2], ("x".to_string(), b"\xff\r".to_vec()));
        assert_eq!(h.body, b"{\"a\":1}\n");
        assert!(Http::parse(b"").headers.is_empty());
        assert_eq!(Http::parse(b"\nbody").body, b"body");
    }
}
