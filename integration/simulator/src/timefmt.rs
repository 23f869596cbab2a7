//! Time formatting helpers: Go-style durations (OpenAI reset headers), RFC 3339 timestamps
//! (Anthropic reset headers) and HTTP-dates (`retry-after: <date>`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Formats `v / 10^prec` fraction digits like Go's `fmtFrac`: ".125", omitting trailing zeros and
/// the point itself when the fraction is zero. Returns the fraction text and the integer part.
fn frac(v: u64, prec: u32) -> (String, u64) {
    let p = 10u64.pow(prec);
    let f = v % p;
    let text = if f == 0 {
        String::new()
    } else {
        let digits = format!("{:0width$}", f, width = prec as usize);
        format!(".{}", digits.trim_end_matches('0'))
    };
    (text, v / p)
}

/// Go's `time.Duration.String()` for a non-negative number of nanoseconds:
/// `0s`, `20ms`, `1.5ms`, `1s`, `1.2s`, `6m0s`, `1m30.5s`, `1h0m0s`.
pub fn go_duration_nanos(u: u64) -> String {
    if u < 1_000_000_000 {
        if u == 0 {
            return "0s".to_string();
        }
        let (unit, prec) = if u < 1_000 {
            ("ns", 0)
        } else if u < 1_000_000 {
            ("µs", 3)
        } else {
            ("ms", 6)
        };
        let (f, i) = frac(u, prec);
        return format!("{i}{f}{unit}");
    }
    let (f, rest) = frac(u, 9);
    let secs = rest % 60;
    let mins_total = rest / 60;
    if mins_total == 0 {
        return format!("{secs}{f}s");
    }
    let mins = mins_total % 60;
    let hours = mins_total / 60;
    if hours == 0 {
        format!("{mins}m{secs}{f}s")
    } else {
        format!("{hours}h{mins}m{secs}{f}s")
    }
}

/// Go-style duration for a whole number of milliseconds.
pub fn go_duration_ms(ms: u64) -> String {
    go_duration_nanos(ms.saturating_mul(1_000_000))
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Converts days since 1970-01-01 to a (year, month, day) civil date (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// RFC 3339 UTC timestamp with whole seconds, e.g. `2026-11-30T16:20:05Z`.
pub fn rfc3339_secs(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// RFC 3339 timestamp of `unix_ms`, rounded UP to the next whole second (a client that waits
/// until this time never comes back early).
pub fn rfc3339_ceil_ms(unix_ms: u64) -> String {
    rfc3339_secs(unix_ms.div_ceil(1000))
}

/// HTTP-date (`Sun, 06 Nov 1994 08:49:37 GMT`) of `unix_ms`, rounded up to the next second.
pub fn http_date_ceil_ms(unix_ms: u64) -> String {
    let secs = unix_ms.div_ceil(1000);
    httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(secs))
}

/// `(year, month)` of the first day of the month after the one containing `unix_secs`.
pub fn next_month(unix_secs: u64) -> (i64, u32) {
    let (y, m, _) = civil_from_days((unix_secs / 86_400) as i64);
    if m == 12 {
        (y + 1, 1)
    } else {
        (y, m + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        assert_eq!(go_duration_ms(0), "0s");
        assert_eq!(go_duration_ms(20), "20ms");
        assert_eq!(go_duration_ms(999), "999ms");
        assert_eq!(go_duration_ms(1000), "1s");
        assert_eq!(go_duration_ms(1200), "1.2s");
        assert_eq!(go_duration_ms(17_280), "17.28s");
        assert_eq!(go_duration_ms(60_000), "1m0s");
        assert_eq!(go_duration_ms(90_500), "1m30.5s");
        assert_eq!(go_duration_ms(360_000), "6m0s");
        assert_eq!(go_duration_ms(3_600_000), "1h0m0s");
        assert_eq!(go_duration_ms(3_723_004), "1h2m3.004s");
        assert_eq!(go_duration_nanos(1_500_000), "1.5ms");
        assert_eq!(go_duration_nanos(1_500), "1.5µs");
        assert_eq!(go_duration_nanos(7), "7ns");
    }

    #[test]
    fn rfc3339_and_http_dates() {
        assert_eq!(rfc3339_secs(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_secs(1_796_055_605), "2026-11-30T16:20:05Z");
        assert_eq!(rfc3339_secs(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_ceil_ms(1_796_055_604_001), "2026-11-30T16:20:05Z");
        assert_eq!(
            http_date_ceil_ms(784_111_776_500),
            "Sun, 06 Nov 1994 08:49:37 GMT"
        );
        assert_eq!(next_month(1_796_055_605), (2026, 12));
        assert_eq!(next_month(1_796_055_605 + 10 * 86_400), (2027, 1));
    }
}
