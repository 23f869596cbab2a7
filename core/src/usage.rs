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
/// Cache reads: Anthropic's beside its input, OpenAI's (`prompt_tokens_details`) and Gemini's
/// inside their prompt counts.
const CACHE_READ_KEYS: [&[u8]; 3] = [
    b"\"cache_read_input_tokens\"",
    b"\"cached_tokens\"",
    b"\"cachedContentTokenCount\"",
];

/// A response's usage as its provider reported it, each field only when it did
/// (`counting::counted` reads it as the provider counts it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// `prompt_tokens`, `input_tokens` (Anthropic: uncached), `promptTokenCount`.
    pub input: Option<u64>,
    /// `completion_tokens`, `output_tokens`, `candidatesTokenCount`.
    pub output: Option<u64>,
    /// `total_tokens`, `totalTokenCount`.
    pub total: Option<u64>,
    /// `cache_creation_input_tokens`.
    pub cache_write: Option<u64>,
    /// `cache_read_input_tokens`, `cached_tokens`, `cachedContentTokenCount`.
    pub cache_read: Option<u64>,
}

/// Longest key plus separator and a 20-digit number: a tail this long carries any split match.
const TAIL: usize = 64;

/// Reads usage from a body fed chunk by chunk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageScanner {
    tail: Vec<u8>,
    seen: Usage,
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
            (&CACHE_READ_KEYS[..], 4),
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
                        let u = &mut self.seen;
                        *match slot {
                            0 => &mut u.input,
                            1 => &mut u.output,
                            2 => &mut u.total,
                            3 => &mut u.cache_write,
                            _ => &mut u.cache_read,
                        } = Some(n);
                    }
                }
            }
        }
        let keep = buf.len().min(TAIL);
        self.tail = buf[buf.len() - keep..].to_vec();
    }

    /// What the body reported, when it reported any usage.
    pub fn usage(&self) -> Option<Usage> {
        (self.seen != Usage::default()).then_some(self.seen)
    }

    /// Tokens the response consumed: the provider's total, else input (with cache writes)
    /// plus output.
    pub fn total(&self) -> Option<u64> {
        let u = &self.seen;
        u.total.or(match (u.input, u.output) {
            (None, None) => None,
            (i, o) => Some(
                i.unwrap_or(0)
                    .saturating_add(o.unwrap_or(0))
                    .saturating_add(u.cache_write.unwrap_or(0)),
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
