//! Token estimates from a request body, before the call: what a reserving token limit takes
//! (`limits.rs`). One pass over the JSON, no allocation, no tokenizer: the text of every string
//! value (messages, system, contents, tools' descriptions and schemas) is counted with a
//! heuristic shaped like the BPE tokenizers the providers use, plus the output the request
//! allows (`max_tokens` and its dialect spellings). `bench/estimate` measures the heuristic
//! against tiktoken's `o200k_base` on the sample set in `bench/estimate/samples`.
//!
//! Bad input never fails: a body that is not JSON (truncated, compressed, another format) is
//! estimated from its length, values nested deeper than `MAX_DEPTH` still count as text, and a
//! `max_tokens` that is negative, fractional, a string or absurd is ignored or capped.

use crate::time;

/// How much of a body is read; the rest is estimated from its length.
pub const MAX_BODY: usize = 256 * 1024;

/// Containers tracked for key context; deeper values are still counted, as text.
const MAX_DEPTH: usize = 32;

/// Bytes per token for text that is estimated from its length alone (beyond `MAX_BODY`, or a
/// body that is not JSON): English prose runs at about 4.
const BYTES_PER_TOKEN: u64 = 4;

/// Tokens the providers add per chat message (role and separators; OpenAI documents 3 to 4).
const PER_MESSAGE: u64 = 4;

/// An inline image (`data:` URL or base64 `data`): counted at a flat cost, since its tokens
/// depend on its pixels, not its bytes (OpenAI: 85 to ~1,100 per image by size and detail).
const IMAGE: u64 = 765;

/// Output limits larger than this are treated as this: no model produces more in one answer,
/// and a reservation must stay a number a bucket can hold.
pub const MAX_OUTPUT: u64 = 1 << 20;

/// Keys whose string values are names, ids or enums, not text a model reads as prose.
const NOT_TEXT: [&[u8]; 12] = [
    b"model",
    b"role",
    b"type",
    b"id",
    b"tool_call_id",
    b"tool_use_id",
    b"mime_type",
    b"mimeType",
    b"media_type",
    b"detail",
    b"finish_reason",
    b"stream",
];

/// The output limit, in every dialect's spelling.
const OUTPUT_KEYS: [&[u8]; 4] = [
    b"max_tokens",
    b"max_completion_tokens",
    b"max_output_tokens",
    b"maxOutputTokens",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Estimate {
    /// Estimated prompt tokens.
    pub input: u64,
    /// The output limit the request sets, when it sets a usable one (a non-negative integer).
    pub max_output: Option<u64>,
    /// Where the top-level `model` string is in the body (its raw bytes, escapes and all).
    pub model: Option<(usize, usize)>,
    /// The whole body's length in bytes.
    pub bytes: u64,
}

impl Estimate {
    /// What to take from a token bucket before forwarding: input plus the output the request
    /// allows, or `default_output` when it sets none.
    pub fn reservation(&self, default_output: u64) -> u64 {
        self.input
            .saturating_add(self.max_output.unwrap_or(default_output))
    }

    /// `reservation` with the input counted as OpenAI's rate limiter documents it, from the
    /// character count (the body's bytes / 4) when that is more than the estimate.
    pub fn by_characters(&self, default_output: u64) -> u64 {
        Estimate {
            input: self.input_by_characters(),
            ..*self
        }
        .reservation(default_output)
    }

    /// The input as OpenAI's rate limiter counts it: the larger of the estimate and the
    /// body's characters / 4.
    pub fn input_by_characters(&self) -> u64 {
        self.input.max(self.bytes.div_ceil(BYTES_PER_TOKEN))
    }
}

/// Estimate a request from (the first `MAX_BODY` bytes of) its body; `total_len` is the whole
/// body's length, when known to be larger than what was read.
pub fn estimate(body: &[u8], total_len: usize) -> Estimate {
    let read = &body[..body.len().min(MAX_BODY)];
    let beyond = (total_len.max(body.len()) - read.len()) as u64 / BYTES_PER_TOKEN;
    let mut est = match scan(read, read.len() < body.len() || beyond > 0) {
        Some(e) => e,
        None => Estimate {
            input: (read.len() as u64).div_ceil(BYTES_PER_TOKEN),
            ..Estimate::default()
        },
    };
    est.input = est.input.saturating_add(beyond);
    est.bytes = total_len.max(body.len()) as u64;
    est
}

/// A key, kept if short enough to be one we look for.
#[derive(Clone, Copy, Default)]
struct Key {
    len: u8,
    bytes: [u8; 24],
}

impl Key {
    fn of(raw: &[u8]) -> Key {
        let mut k = Key::default();
        if raw.len() <= k.bytes.len() {
            k.len = raw.len() as u8;
            k.bytes[..raw.len()].copy_from_slice(raw);
        } else {
            k.len = u8::MAX; // too long to be any of ours
        }
        k
    }
    fn is(&self, name: &[u8]) -> bool {
        usize::from(self.len) == name.len() && &self.bytes[..name.len()] == name
    }
    fn any(&self, names: &[&[u8]]) -> bool {
        names.iter().any(|n| self.is(n))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Frame {
    Object,
    Array,
}

/// One pass over JSON. None when the bytes are not JSON (a truncated body, `cut`, is accepted
/// up to where it stops).
fn scan(b: &[u8], cut: bool) -> Option<Estimate> {
    let mut est = Estimate::default();
    // Each open container, with the key it is the value of.
    let mut frames = [(Frame::Object, Key::default()); MAX_DEPTH];
    let mut depth = 0usize; // may exceed MAX_DEPTH: frames past it are not tracked
    let mut key = Key::default(); // the key of the value about to come
    let mut expect_key = false;
    let mut i = 0;
    let mut seen_value = false;
    while i < b.len() {
        let c = b[i];
        match c {
            b' ' | b'\t' | b'\n' | b'\r' | b',' | b':' => {
                if c == b',' && matches!(top(&frames, depth), Some((Frame::Object, _))) {
                    expect_key = true;
                }
                i += 1;
            }
            b'{' | b'[' => {
                if depth < MAX_DEPTH {
                    let frame = if c == b'{' {
                        Frame::Object
                    } else {
                        Frame::Array
                    };
                    frames[depth] = (frame, key);
                }
                depth += 1;
                expect_key = c == b'{';
                seen_value = true;
                i += 1;
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                key = Key::default(); // the container was the value of its key
                expect_key = false;
                i += 1;
            }
            b'"' => {
                let (end, closed) = string_end(b, i + 1);
                if !closed && !cut {
                    return None;
                }
                let raw = &b[i + 1..end];
                let top = top(&frames, depth);
                let in_object = matches!(top, Some((Frame::Object, _)));
                if expect_key && in_object {
                    key = Key::of(raw);
                    expect_key = false;
                    if key.is(b"role") {
                        est.input = est.input.saturating_add(PER_MESSAGE);
                    }
                } else {
                    let context = match top {
                        // An array's strings count as what the array is.
                        Some((Frame::Array, array_key)) => array_key,
                        _ => key,
                    };
                    est.input = est.input.saturating_add(string_tokens(raw, &context));
                    if depth == 1 && closed && key.is(b"model") && est.model.is_none() {
                        est.model = Some((i + 1, end));
                    }
                    if in_object {
                        key = Key::default();
                    }
                }
                seen_value = true;
                i = end + 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < b.len() && matches!(b[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                if key.any(&OUTPUT_KEYS) && depth <= 2 {
                    // JSON allows `200`, not `"200"`; `-1` and `2.5` are not digits.
                    if let Some(n) = time::whole_number(&b[start..i]) {
                        est.max_output = Some(n.min(MAX_OUTPUT));
                    }
                }
                key = Key::default();
                seen_value = true;
            }
            b't' | b'f' | b'n' => {
                let word: &[u8] = match c {
                    b't' => b"true",
                    b'f' => b"false",
                    _ => b"null",
                };
                let got = &b[i..(i + word.len()).min(b.len())];
                if got != word && !(cut && word.starts_with(got)) {
                    return None;
                }
                i += word.len();
                key = Key::default();
                seen_value = true;
            }
            _ => return None,
        }
    }
    if !seen_value || (depth != 0 && !cut) {
        return None;
    }
    Some(est)
}

/// The innermost open container, when it is tracked.
fn top(frames: &[(Frame, Key); MAX_DEPTH], depth: usize) -> Option<(Frame, Key)> {
    (1..=MAX_DEPTH).contains(&depth).then(|| frames[depth - 1])
}

/// Where the string starting at `from` (just after its opening quote) ends, and whether it
/// was closed before the bytes ran out.
fn string_end(b: &[u8], from: usize) -> (usize, bool) {
    let mut i = from;
    // The bytes that matter are rare in text: find the next one, not every byte's class.
    while let Some(off) = b.get(i..).and_then(|r| memchr::memchr2(b'"', b'\\', r)) {
        i += off;
        if b[i] == b'"' {
            return (i, true);
        }
        i += 2;
    }
    (b.len(), false)
}

/// Tokens of a fragment of a JSON body (a run of values that need not be one valid value: a
/// prompt's blocks from one cache breakpoint to the next), counted as `estimate` counts the
/// same strings: a string followed by `:` is a key (a `role` adds a message's overhead), any
/// other string is text read in the context of the last key. Never fails.
pub fn fragment_tokens(b: &[u8]) -> u64 {
    let mut tokens = 0u64;
    let mut key = Key::default();
    let mut i = 0;
    while let Some(off) = b.get(i..).and_then(|r| memchr::memchr(b'"', r)) {
        let start = i + off + 1;
        let (end, _) = string_end(b, start);
        let raw = &b[start..end];
        let after = b.get(end + 1..).unwrap_or(&[]);
        let is_key = after.iter().find(|c| !c.is_ascii_whitespace()) == Some(&b':');
        if is_key {
            key = Key::of(raw);
            if key.is(b"role") {
                tokens = tokens.saturating_add(PER_MESSAGE);
            }
        } else {
            tokens = tokens.saturating_add(string_tokens(raw, &key));
        }
        i = end + 1;
    }
    tokens
}

/// Tokens of one string value, by what its key says it is.
fn string_tokens(raw: &[u8], key: &Key) -> u64 {
    if key.any(&NOT_TEXT) {
        return 1;
    }
    if raw.starts_with(b"data:") || (key.is(b"data") && raw.len() > 256) {
        return IMAGE;
    }
    text_tokens(raw)
}

/// The heuristic: BPE tokenizers (cl100k, o200k) make a common word one token with its leading
/// space, split long or rare words (about every 5 letters past 7) and runs of digits (at most 3
/// digits a token), merge punctuation (about 3 characters a token) and whitespace, and spend
/// about 3 tokens on 4 CJK or kana characters. JSON escapes count as the character they stand
/// for. The constants were fitted on `bench/estimate/samples.jsonl` and checked on
/// `samples-holdout.jsonl`, which they were not fitted on.
pub fn text_tokens(raw: &[u8]) -> u64 {
    let mut tokens = 0u64;
    let mut i = 0;
    while i < raw.len() {
        let c = raw[i];
        if c == b' ' {
            i += 1; // joins the next word
        } else if c.is_ascii_alphabetic() || (0xC0..=0xDF).contains(&c) {
            // A word: ASCII letters and 2-byte characters (accented Latin, Greek, Cyrillic),
            // measured in characters.
            let mut chars = 0;
            loop {
                let start = i;
                while raw.get(i).is_some_and(u8::is_ascii_alphabetic) {
                    i += 1;
                }
                chars += i - start;
                match raw.get(i) {
                    Some(0xC0..=0xDF) => {
                        i = (i + 2).min(raw.len());
                        chars += 1;
                    }
                    _ => break,
                }
            }
            tokens += word_tokens(chars);
        } else if c.is_ascii_digit() {
            let start = i;
            while i < raw.len() && raw[i].is_ascii_digit() {
                i += 1;
            }
            tokens += (i - start).div_ceil(3) as u64;
        } else if c == b'\\' && i + 1 < raw.len() {
            // An escape (\n, \", \uXXXX ...) is the one character it stands for; runs of escaped
            // newlines and tabs merge like whitespace.
            i = (i + if raw[i + 1] == b'u' { 6 } else { 2 }).min(raw.len());
            while i + 1 < raw.len() && raw[i] == b'\\' && matches!(raw[i + 1], b'n' | b't') {
                i += 2;
            }
            tokens += 1;
        } else if c.is_ascii() {
            // Punctuation and control: runs merge, about three characters a token.
            let start = i;
            while i < raw.len()
                && raw[i].is_ascii_punctuation()
                && raw[i] != b'\\'
                && i - start < 64
            {
                i += 1;
            }
            if i == start {
                i += 1; // a control byte or whitespace other than space
            }
            tokens += (i - start).div_ceil(3) as u64;
        } else {
            // 3- and 4-byte characters (CJK, kana, emoji): about three tokens for four.
            let start = i;
            while i < raw.len() && raw[i] >= 0xE0 {
                i = (i + if raw[i] >= 0xF0 { 4 } else { 3 }).min(raw.len());
                while i < raw.len() && (0x80..0xC0).contains(&raw[i]) {
                    i += 1; // stray continuation bytes belong to the character
                }
            }
            if i == start {
                i += 1; // a stray continuation byte
            }
            let chars = raw[start..i].iter().filter(|b| **b >= 0xE0).count().max(1);
            tokens += (chars * 3).div_ceil(4) as u64;
        }
    }
    tokens
}

/// Tokens of an ASCII word of `len` letters: most English words up to 7 letters are one token,
/// longer ones split about every 5 letters.
fn word_tokens(len: usize) -> u64 {
    if len <= 7 {
        1
    } else {
        1 + (len - 7).div_ceil(5) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_body_counts_text_messages_and_output() {
        let body = br#"{"model":"gpt-4o-mini","max_tokens":200,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello to the world."}]}"#;
        let e = estimate(body, body.len());
        assert_eq!(e.max_output, Some(200));
        // 2 messages x 4 + "You are terse." (4) + "Say hello to the world." (6) + model (1)
        assert!((15..=22).contains(&e.input), "{e:?}");
        assert_eq!(e.reservation(1000), e.input + 200);
    }

    #[test]
    fn every_dialects_output_limit() {
        for body in [
            &br#"{"max_completion_tokens":7,"messages":[]}"#[..],
            br#"{"max_output_tokens":7,"input":"hi"}"#,
            br#"{"contents":[],"generationConfig":{"maxOutputTokens":7}}"#,
        ] {
            assert_eq!(
                estimate(body, body.len()).max_output,
                Some(7),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn bad_output_limits_are_ignored_or_capped() {
        for (body, want) in [
            (&br#"{"max_tokens":-5}"#[..], None),
            (br#"{"max_tokens":"200"}"#, None),
            (br#"{"max_tokens":2.5}"#, None),
            (
                br#"{"max_tokens":99999999999999999999999999}"#,
                Some(MAX_OUTPUT),
            ),
            (br#"{"a":{"b":{"max_tokens":5}}}"#, None), // not where any dialect puts it
        ] {
            assert_eq!(
                estimate(body, body.len()).max_output,
                want,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn not_json_is_estimated_from_its_length() {
        for body in [
            &b"\x1f\x8b\x08\x00garbage"[..],
            b"hello world",
            b"{\"a\":x}",
            b"",
            b"]",
        ] {
            let e = estimate(body, body.len());
            assert_eq!(e.input, (body.len() as u64).div_ceil(4), "{body:?}");
            assert_eq!(e.max_output, None);
        }
    }

    #[test]
    fn a_body_cut_at_the_bound_counts_what_was_read_and_the_rest_by_length() {
        let text = "word ".repeat(100_000); // 500 KB
        let body =
            format!(r#"{{"max_tokens":10,"messages":[{{"role":"user","content":"{text}"}}]}}"#);
        let e = estimate(&body.as_bytes()[..MAX_BODY], body.len());
        assert_eq!(e.max_output, Some(10));
        let words = 100_000u64;
        assert!(
            e.input > words * 8 / 10 && e.input < words * 12 / 10,
            "{e:?}"
        );
    }

    #[test]
    fn deep_nesting_neither_panics_nor_loses_text() {
        let open = "[".repeat(10_000);
        let close = "]".repeat(10_000);
        let body = format!(r#"{{"max_tokens":3,"x":{open}"some text here"{close}}}"#);
        let e = estimate(body.as_bytes(), body.len());
        assert_eq!(e.max_output, Some(3));
        assert!(e.input >= 3);
        let unbalanced = "{\"a\":".repeat(5000);
        estimate(unbalanced.as_bytes(), unbalanced.len()); // must not panic
    }

    #[test]
    fn inline_images_cost_a_flat_amount_not_their_bytes() {
        let b64 = "A".repeat(200_000);
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}}]}}]}}"#
        );
        let e = estimate(body.as_bytes(), body.len());
        assert!(e.input < IMAGE + 20, "{e:?}");
    }

    #[test]
    fn cjk_counts_about_three_tokens_for_four_characters() {
        let t = text_tokens("令牌估计在调用之前进行".as_bytes()); // 11 characters
        assert_eq!(t, 9);
    }
}
