//! Parsers for every time format providers put in headers and bodies.
//!
//! All of them take untrusted text and return `None` rather than guess: a malformed value is
//! ignored and the next delay source is tried. Results are milliseconds, rounded up, because
//! rounding a wait down would send a client back before the provider said it may return.

/// Upper bound on any parsed delay: one year. Later clamps make it smaller still; this bound
/// only keeps arithmetic far away from overflow.
pub const MAX_PARSED_MS: u64 = 365 * 24 * 3600 * 1000;

/// Parse a non-negative decimal number (`12`, `1.5`, `.5`, `0.25`) scaled by `unit_ms`, rounded
/// up to whole milliseconds. Rejects signs, exponents, hex, NaN, infinities and empty input.
pub fn parse_decimal_ms(s: &str, unit_ms: u64) -> Option<u64> {
    scaled_decimal(s, unit_ms).map(|ms| ms.min(MAX_PARSED_MS))
}

/// A run of ASCII digits as a number, saturating at `u64::MAX` ("more than we can count" is
/// still not zero); None when empty or anything but digits.
pub(crate) fn whole_number(raw: &[u8]) -> Option<u64> {
    if raw.is_empty() || !raw.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(raw.iter().fold(0u64, |n, d| {
        n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
    }))
}

/// `s` (a non-negative decimal) times `unit`, rounded up, saturating.
fn scaled_decimal(s: &str, unit_ms: u64) -> Option<u64> {
    let s = s.trim();
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, f),
        None => (s, ""),
    };
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    if !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Integer part: saturate instead of overflowing; anything this large is clamped anyway.
    let whole = whole_number(int.as_bytes()).unwrap_or(0);
    let mut ms = whole.saturating_mul(unit_ms);
    // Fractional part: keep up to 9 digits (nanosecond precision for a seconds unit).
    let mut num: u64 = 0;
    let mut den: u64 = 1;
    for b in frac.bytes().take(9) {
        num = num * 10 + u64::from(b - b'0');
        den *= 10;
    }
    let extra_tail = frac.bytes().skip(9).any(|b| b != b'0');
    if num > 0 || extra_tail {
        let scaled = num.saturating_mul(unit_ms);
        let mut frac_ms = scaled / den;
        if scaled % den != 0 || extra_tail {
            frac_ms += 1;
        }
        ms = ms.saturating_add(frac_ms);
    }
    Some(ms)
}

/// Go `time.Duration` strings as OpenAI sends them in `x-ratelimit-reset-*`: `6m0s`, `1.5s`,
/// `20ms`, `1m30.5s`, `1h2m3s`, `250us`. A bare `0` is zero.
pub fn parse_go_duration_ms(s: &str) -> Option<u64> {
    let s = s.trim();
    if s == "0" {
        return Some(0);
    }
    if s.is_empty() {
        return None;
    }
    // What OpenAI sends on nearly every response ("6ms", "0s", "17s"): whole milliseconds or
    // seconds, read without the general loop below (which gives the same answer).
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if let Some(n) = whole_number(&s.as_bytes()[..digits]) {
        match &s[digits..] {
            "ms" => return Some(n.min(MAX_PARSED_MS)),
            "s" => return Some(n.saturating_mul(1000).min(MAX_PARSED_MS)),
            _ => {}
        }
    }
    let mut rest = s;
    let mut total_ns: u128 = 0;
    while !rest.is_empty() {
        let num_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        if num_len == 0 {
            return None;
        }
        let (num, tail) = rest.split_at(num_len);
        let unit_len = tail
            .char_indices()
            .find(|(_, c)| c.is_ascii_digit() || *c == '.')
            .map_or(tail.len(), |(i, _)| i);
        let (unit, next) = tail.split_at(unit_len);
        let unit_ns: u64 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        // parse_decimal_ms with a nanosecond unit yields nanoseconds (rounded up).
        let ns = scaled_decimal(num, unit_ns)?;
        total_ns = total_ns.saturating_add(u128::from(ns));
        rest = next;
    }
    let ms = total_ns.div_ceil(1_000_000);
    Some(u64::try_from(ms).unwrap_or(u64::MAX).min(MAX_PARSED_MS))
}

/// Protobuf JSON `Duration` as Gemini writes `RetryInfo.retryDelay`: `"17s"`, `"0.5s"`.
pub fn parse_proto_duration_ms(s: &str) -> Option<u64> {
    parse_decimal_ms(s.trim().strip_suffix('s')?, 1000)
}

/// Days since 1970-01-01 for a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Exactly `n` digits.
fn digits(s: &str, n: usize) -> Option<u32> {
    if s.len() != n {
        return None;
    }
    u32::try_from(whole_number(s.as_bytes())?).ok()
}

/// RFC 3339 timestamps as Anthropic sends them in `anthropic-ratelimit-*-reset`:
/// `2026-11-30T16:20:05Z`, with optional fraction and numeric offset. Returns Unix ms.
pub fn parse_rfc3339_ms(s: &str) -> Option<i64> {
    let s = s.trim();
    if !s.is_ascii() || s.len() < 20 {
        return None;
    }
    let (date, rest) = (s.get(0..10)?, s.get(10..)?);
    let sep = rest.as_bytes().first()?;
    if !matches!(sep, b'T' | b't' | b' ') {
        return None;
    }
    let rest = &rest[1..];
    let (year, month, day) = (
        digits(date.get(0..4)?, 4)?,
        digits(date.get(5..7)?, 2)?,
        digits(date.get(8..10)?, 2)?,
    );
    if date.as_bytes()[4] != b'-' || date.as_bytes()[7] != b'-' {
        return None;
    }
    let (hh, mm, ss) = (
        digits(rest.get(0..2)?, 2)?,
        digits(rest.get(3..5)?, 2)?,
        digits(rest.get(6..8)?, 2)?,
    );
    if rest.as_bytes()[2] != b':' || rest.as_bytes()[5] != b':' {
        return None;
    }
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    let mut tail = &rest[8..];
    let mut frac_ms: i64 = 0;
    if let Some(f) = tail.strip_prefix('.') {
        let n = f.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return None;
        }
        // Round the fraction up to a whole millisecond.
        frac_ms = i64::try_from(parse_decimal_ms(&format!("0.{}", &f[..n]), 1000)?).ok()?;
        tail = &f[n..];
    }
    let offset_s: i64 = match tail {
        "Z" | "z" => 0,
        _ => {
            let sign = match tail.as_bytes().first()? {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            if tail.len() != 6 || tail.as_bytes()[3] != b':' {
                return None;
            }
            let (oh, om) = (digits(&tail[1..3], 2)?, digits(&tail[4..6], 2)?);
            if oh > 23 || om > 59 {
                return None;
            }
            sign * (i64::from(oh) * 3600 + i64::from(om) * 60)
        }
    };
    let days = days_from_civil(i64::from(year), month, day);
    let secs = days * 86_400 + i64::from(hh) * 3600 + i64::from(mm) * 60 + i64::from(ss) - offset_s;
    Some(secs * 1000 + frac_ms)
}

/// IMF-fixdate and the obsolete HTTP-date forms, as `Retry-After` may carry. Returns Unix ms.
pub fn parse_http_date_ms(s: &str) -> Option<i64> {
    let t = httpdate::parse_http_date(s.trim()).ok()?;
    let d = t.duration_since(std::time::UNIX_EPOCH).ok()?;
    i64::try_from(d.as_millis()).ok()
}

/// Milliseconds from `now_ms` until the absolute time `at_ms`; `None` when it is not in the
/// future (a reset that already passed says nothing about how long to wait).
pub fn until(at_ms: i64, now_ms: u64) -> Option<u64> {
    let now = i64::try_from(now_ms).ok()?;
    let d = at_ms.checked_sub(now)?;
    (d > 0).then(|| u64::try_from(d).unwrap_or(0).min(MAX_PARSED_MS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal() {
        assert_eq!(parse_decimal_ms("2", 1000), Some(2000));
        assert_eq!(parse_decimal_ms("1.5", 1000), Some(1500));
        assert_eq!(parse_decimal_ms("0.0001", 1000), Some(1));
        assert_eq!(parse_decimal_ms(".5", 1000), Some(500));
        assert_eq!(parse_decimal_ms("20", 1), Some(20));
        assert_eq!(parse_decimal_ms("20.1", 1), Some(21));
        for bad in [
            "", ".", "-1", "+1", "1e3", "NaN", "inf", "0x10", "1.2.3", " ", "1 2",
        ] {
            assert_eq!(parse_decimal_ms(bad, 1000), None, "{bad:?}");
        }
        assert_eq!(
            parse_decimal_ms("99999999999999999999999", 1000),
            Some(MAX_PARSED_MS)
        );
    }

    #[test]
    fn go_durations() {
        for (s, ms) in [
            ("6m0s", 360_000),
            ("1.5s", 1500),
            ("20ms", 20),
            ("1m30.5s", 90_500),
            ("1h2m3s", 3_723_000),
            ("250us", 1),
            ("0", 0),
            ("0s", 0),
            ("999ns", 1),
        ] {
            assert_eq!(parse_go_duration_ms(s), Some(ms), "{s}");
        }
        for bad in [
            "", "s", "5", "5x", "-1s", "1.5", "m5", "1s2", "NaNs", "5ms5", "5sms",
        ] {
            assert_eq!(parse_go_duration_ms(bad), None, "{bad:?}");
        }
        // Whole ms and s take a shortcut; written with a fraction they take the general loop:
        // both give the same answer, up to the cap and past it.
        for n in [
            0u64,
            1,
            6,
            17,
            999,
            60_000,
            31_536_000_000,
            999_999_999_999,
            1_000_000_000_000,
        ] {
            for unit in ["ms", "s"] {
                let whole = format!("{n}{unit}");
                let general = format!("{n}.0{unit}");
                assert_eq!(
                    parse_go_duration_ms(&whole),
                    parse_go_duration_ms(&general),
                    "{whole}"
                );
                assert_eq!(
                    parse_go_duration_ms(&format!("0{whole}")),
                    parse_go_duration_ms(&whole)
                );
            }
        }
        assert_eq!(parse_go_duration_ms("2s"), Some(2000));
        assert_eq!(parse_go_duration_ms("9999999999999s"), Some(MAX_PARSED_MS));
    }

    #[test]
    fn rfc3339() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T16:20:05Z"),
            Some(1_796_055_605_000)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T16:20:05.5Z"),
            Some(1_796_055_605_500)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T17:20:05+01:00"),
            Some(1_796_055_605_000)
        );
        for bad in [
            "",
            "2026-11-30",
            "2026-13-30T16:20:05Z",
            "2026-11-30T16:20:05",
            "garbage-here-too-long",
        ] {
            assert_eq!(parse_rfc3339_ms(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn http_date() {
        assert_eq!(
            parse_http_date_ms("Thu, 01 Jan 1970 00:00:10 GMT"),
            Some(10_000)
        );
        assert_eq!(parse_http_date_ms("not a date"), None);
    }
}
