//! The few protobuf messages of the rate-limit services a fleet shares budgets through, encoded
//! and decoded by hand (no code generator, no dependency): Envoy's
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, and Kuadrant Limitador's
//! `kuadrant.service.ratelimit.v1` Reserve and Commit (a token budget reserved before the call
//! and settled after it). Field numbers are the services' own; a host only moves the bytes.
//!
//! `fleet::limits` says what is asked, `fleet::ask` what an answer means; the worker sends them.
//!
//! Decoding takes whatever a service sends: unknown fields are skipped by their wire type (as
//! proto3 does), and a truncated or malformed message is an error value, never a panic.

/// One request's view of one fleet limit: the descriptor an operator's limits file matches,
/// the limit's name (under the entries `names` says) and `key` = the key's value for this
/// request (never a raw credential: an account key is its label or keyed id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub limit: String,
    pub key: String,
    pub names: Names,
}

/// Which entries of a descriptor carry the limit's name. A fleet slot is a hold on two limits
/// of the same cap: the cap (`limit`) and its guard (`guard`); admission asks both at once,
/// and each is taken again on its own (`fleet::slots`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Names {
    /// `limit`: every fleet limit, and a slot's cap alone.
    Limit,
    /// `guard`: a slot's guard alone.
    Guard,
    /// `limit` and `guard`: a slot's admission, and its release while both holds are one.
    Both,
}

/// `RateLimitRequest{domain = 1, descriptors = 2, hits_addend = 3}`.
pub fn should_rate_limit(domain: &str, descriptors: &[Descriptor], hits: u32) -> Vec<u8> {
    let mut out = Vec::new();
    put_str(&mut out, 1, domain);
    for d in descriptors {
        put_msg(&mut out, 2, &descriptor(d));
    }
    if hits != 1 {
        put_varint_field(&mut out, 3, u64::from(hits));
    }
    out
}

/// `ReserveRequest{domain = 1, descriptors = 2, amount = 3, ttl = 4 (Duration)}`.
pub fn reserve(domain: &str, descriptors: &[Descriptor], amount: u64, ttl_ms: u64) -> Vec<u8> {
    let mut out = Vec::new();
    put_str(&mut out, 1, domain);
    for d in descriptors {
        put_msg(&mut out, 2, &descriptor(d));
    }
    put_varint_field(&mut out, 3, amount);
    put_msg(&mut out, 4, &duration(ttl_ms));
    out
}

/// `CommitRequest{domain = 1, descriptors = 2, reservation_id = 3, actual_amount = 4}`.
pub fn commit(domain: &str, descriptors: &[Descriptor], reservation: &str, actual: u64) -> Vec<u8> {
    let mut out = Vec::new();
    put_str(&mut out, 1, domain);
    for d in descriptors {
        put_msg(&mut out, 2, &descriptor(d));
    }
    put_str(&mut out, 3, reservation);
    put_varint_field(&mut out, 4, actual);
    out
}

/// `RateLimitResponse.Code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    Unknown,
    Ok,
    OverLimit,
}

impl Code {
    fn from_wire(v: u64) -> Code {
        match v {
            1 => Code::Ok,
            2 => Code::OverLimit,
            _ => Code::Unknown,
        }
    }
}

/// What a `ShouldRateLimit` (or Reserve) answer says.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Answer {
    pub code: Option<Code>,
    /// The longest `duration_until_reset` of a descriptor over its limit (or of any, when none
    /// is), in ms: the wait the service reports.
    pub wait_ms: Option<u64>,
    /// The fewest `limit_remaining` reported.
    pub remaining: Option<u64>,
    /// Reserve only: the id to commit against.
    pub reservation: Option<String>,
}

/// Why a service's bytes could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    Truncated,
    BadWireType,
    TooLong,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DecodeError::Truncated => "truncated message",
            DecodeError::BadWireType => "unknown wire type",
            DecodeError::TooLong => "varint longer than 10 bytes",
        })
    }
}

/// A `RateLimitResponse{overall_code = 1, statuses = 2, response_headers_to_add = 3}`;
/// `DescriptorStatus{code = 1, current_limit = 2, limit_remaining = 3, duration_until_reset =
/// 4}`. Limitador answers `statuses: []` and reports the reset only as the draft-03 headers
/// `X-RateLimit-Reset` (seconds) and `X-RateLimit-Remaining` (with `--rate-limit-headers
/// DRAFT_VERSION_03`): those are read when no status says. Other fields are skipped.
pub fn decode_response(bytes: &[u8]) -> Result<Answer, DecodeError> {
    let mut answer = Answer::default();
    let mut over: Option<u64> = None;
    let mut any: Option<u64> = None;
    let (mut headers_reset, mut headers_remaining) = (None, None);
    for field in Fields(bytes) {
        match field? {
            (1, Value::Varint(v)) => answer.code = Some(Code::from_wire(v)),
            (2, Value::Bytes(status)) => {
                let s = decode_status(status)?;
                if let Some(r) = s.remaining {
                    answer.remaining = Some(answer.remaining.map_or(r, |m| m.min(r)));
                }
                if let Some(w) = s.reset_ms {
                    any = Some(any.map_or(w, |m| m.max(w)));
                    if s.code == Some(Code::OverLimit) {
                        over = Some(over.map_or(w, |m| m.max(w)));
                    }
                }
            }
            (3, Value::Bytes(header)) => {
                let (name, value) = decode_header(header)?;
                let number = || std::str::from_utf8(value).ok()?.trim().parse::<u64>().ok();
                if name.eq_ignore_ascii_case(b"x-ratelimit-reset") {
                    headers_reset = number().map(|secs| secs.saturating_mul(1000));
                } else if name.eq_ignore_ascii_case(b"x-ratelimit-remaining") {
                    headers_remaining = number();
                }
            }
            _ => {}
        }
    }
    answer.wait_ms = over.or(any).or(headers_reset);
    answer.remaining = answer.remaining.or(headers_remaining);
    Ok(answer)
}

/// `config.core.v3.HeaderValue{key = 1, value = 2, raw_value = 3}`.
fn decode_header(bytes: &[u8]) -> Result<(&[u8], &[u8]), DecodeError> {
    let (mut key, mut value): (&[u8], &[u8]) = (b"", b"");
    for field in Fields(bytes) {
        match field? {
            (1, Value::Bytes(k)) => key = k,
            (2, Value::Bytes(v)) | (3, Value::Bytes(v)) => value = v,
            _ => {}
        }
    }
    Ok((key, value))
}

/// A `ReserveResponse{code = 1, reservation_id = 2}`.
pub fn decode_reserve(bytes: &[u8]) -> Result<Answer, DecodeError> {
    let mut answer = Answer::default();
    for field in Fields(bytes) {
        match field? {
            (1, Value::Varint(v)) => answer.code = Some(Code::from_wire(v)),
            (2, Value::Bytes(id)) => {
                answer.reservation = Some(String::from_utf8_lossy(id).into_owned());
            }
            _ => {}
        }
    }
    Ok(answer)
}

struct Status {
    code: Option<Code>,
    remaining: Option<u64>,
    reset_ms: Option<u64>,
}

fn decode_status(bytes: &[u8]) -> Result<Status, DecodeError> {
    let mut s = Status {
        code: None,
        remaining: None,
        reset_ms: None,
    };
    for field in Fields(bytes) {
        match field? {
            (1, Value::Varint(v)) => s.code = Some(Code::from_wire(v)),
            (3, Value::Varint(v)) => s.remaining = Some(v),
            (4, Value::Bytes(d)) => s.reset_ms = Some(decode_duration_ms(d)?),
            _ => {}
        }
    }
    Ok(s)
}

/// `google.protobuf.Duration{seconds = 1, nanos = 2}` in ms (negative reads as 0).
fn decode_duration_ms(bytes: &[u8]) -> Result<u64, DecodeError> {
    let (mut secs, mut nanos) = (0i64, 0i64);
    for field in Fields(bytes) {
        match field? {
            // int64 and int32 travel as two's complement varints.
            (1, Value::Varint(v)) => secs = v as i64,
            (2, Value::Varint(v)) => nanos = i64::from(v as i32),
            _ => {}
        }
    }
    let ms = secs.saturating_mul(1000).saturating_add(nanos / 1_000_000);
    Ok(u64::try_from(ms).unwrap_or(0))
}

fn descriptor(d: &Descriptor) -> Vec<u8> {
    let mut out = Vec::new();
    if d.names != Names::Guard {
        put_msg(&mut out, 1, &entry("limit", &d.limit));
    }
    if d.names != Names::Limit {
        put_msg(&mut out, 1, &entry("guard", &d.limit));
    }
    put_msg(&mut out, 1, &entry("key", &d.key));
    out
}

/// `RateLimitDescriptor.Entry{key = 1, value = 2}`.
fn entry(key: &str, value: &str) -> Vec<u8> {
    let mut out = Vec::new();
    put_str(&mut out, 1, key);
    put_str(&mut out, 2, value);
    out
}

fn duration(ms: u64) -> Vec<u8> {
    let mut out = Vec::new();
    let (secs, nanos) = (ms / 1000, (ms % 1000) * 1_000_000);
    if secs > 0 {
        put_varint_field(&mut out, 1, secs);
    }
    if nanos > 0 {
        put_varint_field(&mut out, 2, nanos);
    }
    out
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    put_varint(out, u64::from(field) << 3);
    put_varint(out, v);
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, u64::from(field) << 3 | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_str(out: &mut Vec<u8>, field: u32, s: &str) {
    put_bytes(out, field, s.as_bytes());
}

fn put_msg(out: &mut Vec<u8>, field: u32, msg: &[u8]) {
    put_bytes(out, field, msg);
}

enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

/// The fields of a message, in order: (field number, value).
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for i in 0..10 {
            let (&b, rest) = self.0.split_first().ok_or(DecodeError::Truncated)?;
            self.0 = rest;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError::TooLong)
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], DecodeError> {
        let n = usize::try_from(n).map_err(|_| DecodeError::Truncated)?;
        if n > self.0.len() {
            return Err(DecodeError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Value<'a>), DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = (|| {
            let tag = self.varint()?;
            let value = match tag & 7 {
                0 => Value::Varint(self.varint()?),
                1 => self.take(8).map(|_| Value::Fixed)?,
                2 => {
                    let n = self.varint()?;
                    Value::Bytes(self.take(n)?)
                }
                5 => self.take(4).map(|_| Value::Fixed)?,
                _ => return Err(DecodeError::BadWireType),
            };
            Ok((tag >> 3, value))
        })();
        if field.is_err() {
            self.0 = &[]; // one error ends the message
        }
        Some(field)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant() -> Vec<Descriptor> {
        vec![Descriptor {
            limit: "rpm".into(),
            key: "t1".into(),
            names: Names::Limit,
        }]
    }

    #[test]
    fn a_should_rate_limit_request_byte_for_byte() {
        // domain "d" (field 1), one descriptor (field 2) of two entries (field 1 each):
        // {key "limit", value "rpm"} and {key "key", value "t1"}; hits_addend 1 is the default.
        let want: Vec<u8> = [
            &[0x0a, 1, b'd'][..],
            &[0x12, 25],
            &[0x0a, 12, 0x0a, 5],
            b"limit",
            &[0x12, 3],
            b"rpm",
            &[0x0a, 9, 0x0a, 3],
            b"key",
            &[0x12, 2],
            b"t1",
        ]
        .concat();
        assert_eq!(should_rate_limit("d", &tenant(), 1), want);
        // Another addend is sent (field 3, varint).
        let more = should_rate_limit("d", &tenant(), 300);
        assert_eq!(&more[want.len()..], &[0x18, 0xac, 0x02]);
    }

    #[test]
    fn a_slot_names_its_cap_its_guard_or_both() {
        let with = |names| {
            let d = Descriptor {
                names,
                ..tenant().remove(0)
            };
            reserve("d", &[d], 1, 1_000)
        };
        let entries = |m: &[u8]| {
            let at = |k: &[u8]| m.windows(k.len()).position(|w| w == k);
            (at(b"limit"), at(b"guard"), at(b"key"))
        };
        let (l, g, k) = entries(&with(Names::Both));
        assert!(l < g && g < k && l.is_some(), "limit, guard, key in order");
        let (l, g, k) = entries(&with(Names::Guard));
        assert!(l.is_none() && g.is_some() && k.is_some());
        let (l, g, _) = entries(&with(Names::Limit));
        assert!(l.is_some() && g.is_none());
        // The guard carries the limit's name as its value.
        let guard = with(Names::Guard);
        assert!(guard.windows(3).any(|w| w == b"rpm"));
    }

    #[test]
    fn reserve_and_commit_carry_amounts_as_top_level_fields() {
        let r = reserve("d", &tenant(), 1_234, 2_500);
        let desc_len = 2 + 25;
        // amount 1234 = 0xd2 0x09 (field 3), ttl {seconds 2, nanos 500_000_000} (field 4).
        assert_eq!(&r[3 + desc_len..3 + desc_len + 3], &[0x18, 0xd2, 0x09]);
        assert_eq!(
            &r[3 + desc_len + 3..],
            &[0x22, 8, 0x08, 2, 0x10, 0x80, 0xca, 0xb5, 0xee, 0x01]
        );
        let c = commit("d", &tenant(), "abc", 5);
        assert_eq!(&c[3 + desc_len..], &[0x1a, 3, b'a', b'b', b'c', 0x20, 5]);
    }

    /// A response as a server writes it: overall code, then statuses.
    fn status(code: u64, remaining: u64, reset_secs: u64, reset_nanos: u64) -> Vec<u8> {
        let mut d = Vec::new();
        put_varint_field(&mut d, 1, reset_secs);
        put_varint_field(&mut d, 2, reset_nanos);
        let mut s = Vec::new();
        put_varint_field(&mut s, 1, code);
        put_msg(&mut s, 2, &[0x08, 10, 0x10, 2]); // current_limit: skipped
        put_varint_field(&mut s, 3, remaining);
        put_msg(&mut s, 4, &d);
        s
    }

    #[test]
    fn responses_give_the_code_the_wait_and_the_remaining() {
        let mut r = Vec::new();
        put_varint_field(&mut r, 1, 2);
        put_msg(&mut r, 2, &status(1, 7, 9, 0));
        put_msg(&mut r, 2, &status(2, 0, 1, 250_000_000));
        put_msg(&mut r, 3, &entry("x-ratelimit-reset", "2")); // headers to add: skipped
        put_varint_field(&mut r, 99, 5); // an unknown field: skipped
        let a = decode_response(&r).unwrap();
        assert_eq!(a.code, Some(Code::OverLimit));
        assert_eq!(
            a.wait_ms,
            Some(1_250),
            "the reset of the descriptor over its limit"
        );
        assert_eq!(a.remaining, Some(0));
        // Limitador answers without statuses: only the code.
        assert_eq!(
            decode_response(&[0x08, 1]).unwrap(),
            Answer {
                code: Some(Code::Ok),
                ..Answer::default()
            }
        );
        assert_eq!(
            decode_response(&[0x08, 7]).unwrap().code,
            Some(Code::Unknown)
        );
        let mut ok = Vec::new();
        put_varint_field(&mut ok, 1, 1);
        put_str(&mut ok, 2, "res-1");
        assert_eq!(
            decode_reserve(&ok).unwrap().reservation.as_deref(),
            Some("res-1")
        );
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        for bad in [
            &[0x08][..],      // a varint cut short
            &[0x12, 5, 1, 2], // a message longer than what is left
            &[0x0b],          // wire type 3 (groups)
            &[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ],
            &[0x12, 3, 0x22, 5, 0x08], // a status whose duration is cut short
        ] {
            assert!(decode_response(bad).is_err(), "{bad:?}");
        }
        assert_eq!(decode_response(&[]).unwrap(), Answer::default());
        // A negative duration reads as no wait.
        let mut d = Vec::new();
        put_varint_field(&mut d, 1, (-5i64) as u64);
        assert_eq!(decode_duration_ms(&d), Ok(0));
    }
}
