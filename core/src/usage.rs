//! Token usage as providers report it, scanned from a response body as it streams past.
//!
//! The body is never buffered: each chunk is scanned and forgotten, keeping only a short tail
//! so a number split across two chunks is still read. Keys are matched as bytes, so plain JSON
//! and SSE streams (OpenAI's final usage chunk, Anthropic's `message_start`/`message_delta`,
//! Gemini's `usageMetadata`) all work, and the last value seen for a key wins (streams report
//! running totals).

/// The usage keys providers use, by what they count.
const INPUT_KEYS: [&[u8]; 3] = [
    b"\"prompt_tokens\"",
    b"\"input_tokens\"",
    b"\"promptTokenCount\"",
];
const OUTPUT_KEYS: [&[u8]; 3] = [
    b"\"completion_tokens\"",
    b"\"output_tokens\"",
    b"\"candidatesTokenCount\"",
];
const TOTAL_KEYS: [&[u8]; 2] = [b"\"total_tokens\"", b"\"totalTokenCount\""];
/// Anthropic counts cache writes towards input-token limits (cache reads it does not).
const CACHE_WRITE_KEYS: [&[u8]; 1] = [b"\"cache_creation_input_tokens\""];

/// Longest key plus separator and a 20-digit number: a tail this long carries any split match.
const TAIL: usize = 64;

/// Reads usage from a body fed chunk by chunk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageScanner {
    tail: Vec<u8>,
    input: Option<u64>,
    output: Option<u64>,
    total: Option<u64>,
    cache_write: Option<u64>,
}

impl UsageScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Scan the next chunk of the body, joined to the tail of the previous one. Matches inside
    /// the tail are read twice, which is harmless: they yield the same values, in order.
    pub fn feed(&mut self, chunk: &[u8]) {
        let mut buf = std::mem::take(&mut self.tail);
        buf.extend_from_slice(chunk);
        for (keys, slot) in [
            (&INPUT_KEYS[..], 0),
            (&OUTPUT_KEYS[..], 1),
            (&TOTAL_KEYS[..], 2),
            (&CACHE_WRITE_KEYS[..], 3),
        ] {
            for key in keys {
                // Every match, overlapping ones too (`"k"k":1` holds `"k":1` from the first
                // key's closing quote): a rescan of the tail alone must not find more than
                // the scan of the whole did (found by fuzzing).
                let mut at = 0;
                while let Some(i) = crate::classify::find(&buf[at..], key) {
                    let start = at + i;
                    at = start + 1;
                    if let Some(n) = number_after(&buf[start + key.len()..]) {
                        match slot {
                            0 => self.input = Some(n),
                            1 => self.output = Some(n),
                            2 => self.total = Some(n),
                            _ => self.cache_write = Some(n),
                        }
                    }
                }
            }
        }
        let keep = buf.len().min(TAIL);
        self.tail = buf[buf.len() - keep..].to_vec();
    }

    /// Tokens the response consumed: the provider's total, else input (with cache writes)
    /// plus output.
    pub fn total(&self) -> Option<u64> {
        self.total.or(match (self.input, self.output) {
            (None, None) => None,
            (i, o) => Some(
                i.unwrap_or(0)
                    .saturating_add(o.unwrap_or(0))
                    .saturating_add(self.cache_write.unwrap_or(0)),
            ),
        })
    }
}

/// After a JSON key: `\s*:\s*` then an unsigned integer. None when the number may continue
/// past the end of `s` (it will be read again across the seam) or is absent.
fn number_after(s: &[u8]) -> Option<u64> {
    let skip_ws = |s: &[u8]| s.iter().take_while(|b| b.is_ascii_whitespace()).count();
    let mut i = skip_ws(s);
    if s.get(i) != Some(&b':') {
        return None;
    }
    i += 1;
    i += skip_ws(&s[i..]);
    let digits = s[i..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || i + digits >= s.len() {
        return None;
    }
    std::str::from_utf8(&s[i..i + digits]).ok()?.parse().ok()
}
