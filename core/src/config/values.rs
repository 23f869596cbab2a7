//! Leaf values: each type is one rule for one value, with the reason it gives when refused.
//! The DTOs (`wire`) are built of these, so a field and its rule are written once.

use super::model::{LimitKey, OnError, OutputRule, Scope, Settle};
use crate::classify::Dialect;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::fmt;
use std::marker::PhantomData;

/// One JSON value as a leaf sees it: a scalar, or only the kind of a container. Leaves read
/// this instead of a `serde_json::Value`, so no tree is copied and no copy is dropped.
#[derive(Clone, Copy)]
pub(super) enum Raw<'a> {
    Null,
    Bool(bool),
    Uint(u64),
    /// A negative integer (non-negative ones are `Uint`).
    Int(i64),
    Float(f64),
    Str(&'a str),
    Array,
    Object,
}

impl<'a> Raw<'a> {
    pub(super) fn kind(self) -> &'static str {
        match self {
            Raw::Null => "null",
            Raw::Bool(_) => "a boolean",
            Raw::Uint(_) | Raw::Int(_) | Raw::Float(_) => "a number",
            Raw::Str(_) => "a string",
            Raw::Array => "an array",
            Raw::Object => "an object",
        }
    }

    fn string(self) -> Result<&'a str, String> {
        match self {
            Raw::Str(s) => Ok(s),
            other => Err(format!("must be a string, got {}", other.kind())),
        }
    }
}

impl<'de> Deserialize<'de> for Raw<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(RawVisitor)
    }
}

struct RawVisitor;

impl<'de> Visitor<'de> for RawVisitor {
    type Value = Raw<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Raw<'de>, E> {
        Ok(Raw::Null)
    }
    fn visit_none<E>(self) -> Result<Raw<'de>, E> {
        Ok(Raw::Null)
    }
    fn visit_bool<E>(self, b: bool) -> Result<Raw<'de>, E> {
        Ok(Raw::Bool(b))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Raw<'de>, E> {
        Ok(Raw::Uint(n))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Raw<'de>, E> {
        Ok(u64::try_from(n).map_or(Raw::Int(n), Raw::Uint))
    }
    fn visit_f64<E>(self, f: f64) -> Result<Raw<'de>, E> {
        Ok(Raw::Float(f))
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Raw<'de>, E> {
        Ok(Raw::Str(s))
    }
    fn visit_seq<S: SeqAccess<'de>>(self, _: S) -> Result<Raw<'de>, S::Error> {
        Ok(Raw::Array)
    }
    fn visit_map<M: MapAccess<'de>>(self, _: M) -> Result<Raw<'de>, M::Error> {
        Ok(Raw::Object)
    }
}

/// A leaf type read from one JSON value by `check`, which says why it refuses one.
macro_rules! leaf {
    ($(#[$doc:meta])* $name:ident($ty:ty) = $check:expr) => {
        $(#[$doc])*
        pub(super) struct $name(pub(super) $ty);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let check: fn(Raw<'_>) -> Result<$ty, String> = $check;
                check(Raw::deserialize(d)?).map($name).map_err(de::Error::custom)
            }
        }
    };
}

leaf!(
    Flag(bool) = |v| match v {
        Raw::Bool(b) => Ok(b),
        other => Err(format!("must be true or false, got {}", other.kind())),
    }
);

leaf!(Text(String) = |v| v.string().map(str::to_string));

leaf!(
    SettleSpec(Settle) = |v| match v.string()? {
        "auto" => Ok(Settle::Auto),
        "usage" => Ok(Settle::Usage),
        "reservation" => Ok(Settle::Reservation),
        s => Err(format!(
            "must be \"auto\", \"usage\" or \"reservation\", got {s:?}"
        )),
    }
);

leaf!(
    OutputSpec(OutputRule) = |v| match v.string()? {
        "generated" => Ok(OutputRule::Generated),
        "max_tokens" => Ok(OutputRule::MaxTokens),
        s => Err(format!(
            "must be \"generated\" or \"max_tokens\", got {s:?}"
        )),
    }
);

leaf!(
    ScopeSpec(Scope) = |v| match v.string()? {
        "local" => Ok(Scope::Local),
        "fleet" => Ok(Scope::Fleet),
        s => Err(format!("must be \"local\" or \"fleet\", got {s:?}")),
    }
);

leaf!(
    OnErrorSpec(OnError) = |v| match v.string()? {
        "local" => Ok(OnError::Local),
        "allow" => Ok(OnError::Allow),
        "deny" => Ok(OnError::Deny),
        s => Err(format!(
            "must be \"local\", \"allow\" or \"deny\", got {s:?}"
        )),
    }
);

leaf!(
    /// `fleet.cluster`: an Envoy cluster name (Envoy's own rule: no control characters, at
    /// most 255 bytes; whether the cluster exists is checked by the host at load).
    ClusterName(String) = |v| {
        let s = v.string()?;
        if s.is_empty() || s.len() > 255 || s.bytes().any(|b| b.is_ascii_control()) {
            Err(format!("must be an Envoy cluster name (1 to 255 printable bytes), got {s:?}"))
        } else {
            Ok(s.to_string())
        }
    }
);

leaf!(
    /// `fleet.domain`: the RLS domain (Limitador's namespace).
    Domain(String) = |v| {
        let s = v.string()?;
        if s.trim().is_empty() {
            Err("must not be empty".into())
        } else if s.len() > 255 {
            Err("must be at most 255 bytes".into())
        } else {
            Ok(s.to_string())
        }
    }
);

leaf!(
    /// `retry_after.jitter`: a fraction of the provider's time.
    Fraction(f64) = |v| {
        let j = match v {
            Raw::Uint(n) => n as f64,
            Raw::Int(n) => n as f64,
            Raw::Float(f) => f,
            _ => return Err("must be a number".into()),
        };
        if (0.0..=1.0).contains(&j) {
            Ok(j)
        } else {
            Err("must be between 0 and 1".into())
        }
    }
);

leaf!(
    /// A header name, lower-cased (Envoy hands them to the filter lower-cased).
    HeaderName(String) = |v| {
        let s = v.string()?;
        if valid_header_name(s) {
            Ok(s.to_ascii_lowercase())
        } else {
            Err(format!("not a valid header name: {s:?}"))
        }
    }
);

leaf!(
    /// Pool and limit names end up in stats names and headers: `[a-z0-9_-]{1,32}`.
    StatName(String) = |v| {
        let s = v.string()?;
        let ok = (1..=32).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if ok {
            Ok(s.to_string())
        } else {
            Err(format!("must match [a-z0-9_-]{{1,32}}, got {s:?}"))
        }
    }
);

leaf!(
    PathPrefix(String) = |v| {
        let s = v.string()?;
        if s.starts_with('/') {
            Ok(s.to_string())
        } else {
            Err("must start with '/'".into())
        }
    }
);

leaf!(
    /// Compared case-insensitively, so kept lower-cased.
    Authority(String) = |v| {
        let s = v.string()?;
        if s.is_empty() {
            Err("must not be empty".into())
        } else {
            Ok(s.to_ascii_lowercase())
        }
    }
);

leaf!(
    /// `pools[].account`: a label, hashed like a credential.
    Label(String) = |v| {
        let s = v.string()?;
        if s.trim().is_empty() {
            Err("must not be empty".into())
        } else {
            Ok(s.to_string())
        }
    }
);

leaf!(
    DialectName(Dialect) = |v| {
        let s = v.string()?;
        Dialect::parse(s).ok_or_else(|| {
            format!(
                "unknown dialect {s:?} (expected openai, anthropic, azure_openai, gemini or auto)"
            )
        })
    }
);

leaf!(
    KeySpec(LimitKey) = |v| {
        let s = v.string()?;
        match s {
            "account" => Ok(LimitKey::Account),
            "pool" => Ok(LimitKey::Pool),
            "model" => Ok(LimitKey::Model { header: None }),
            _ => match s
                .strip_prefix("header:")
                .map(|h| (h.strip_suffix("+model"), h))
            {
                Some((Some(h), _)) if valid_header_name(h) => Ok(LimitKey::Model {
                    header: Some(h.to_ascii_lowercase()),
                }),
                Some((None, h)) if valid_header_name(h) => {
                    Ok(LimitKey::Header(h.to_ascii_lowercase()))
                }
                _ => Err(format!(
                    "must be \"header:<name>\", \"header:<name>+model\", \"account\", \"pool\" \
                     or \"model\", got {s:?}"
                )),
            },
        }
    }
);

/// An integer in `MIN..=MAX`.
pub(super) struct Int<const MIN: u64, const MAX: u64>(pub(super) u64);

impl<'de, const MIN: u64, const MAX: u64> Deserialize<'de> for Int<MIN, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = UncheckedInt::deserialize(d)?;
        int_in(v, MIN, MAX).map(Int).map_err(de::Error::custom)
    }
}

/// A value meant as an integer, whose range is checked later: by `Int` once read, or by a
/// rule once the fields beside it are known. Only what the integer rules need of it is kept.
#[derive(Clone, Copy)]
pub(super) enum UncheckedInt {
    Uint(u64),
    Negative,
    NotAnInteger,
}

impl<'de> Deserialize<'de> for UncheckedInt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match Raw::deserialize(d)? {
            Raw::Uint(n) => UncheckedInt::Uint(n),
            Raw::Int(_) => UncheckedInt::Negative,
            _ => UncheckedInt::NotAnInteger,
        })
    }
}

pub(super) fn int_in(v: UncheckedInt, min: u64, max: u64) -> Result<u64, String> {
    match v {
        UncheckedInt::Uint(n) if (min..=max).contains(&n) => Ok(n),
        UncheckedInt::Uint(_) => Err(format!("must be between {min} and {max}")),
        _ => Err(format!("must be an integer between {min} and {max}")),
    }
}

/// A count or rate: an integer in `1..=max`.
pub(super) fn positive(v: UncheckedInt, max: u64) -> Result<u64, String> {
    match v {
        UncheckedInt::Uint(0) | UncheckedInt::Negative => Err("must be > 0".into()),
        UncheckedInt::Uint(n) if n <= max => Ok(n),
        UncheckedInt::Uint(_) => Err(format!("must be <= {max}")),
        UncheckedInt::NotAnInteger => Err("must be a positive integer".into()),
    }
}

/// An array of at most `MAX` entries (the length is checked before any entry).
pub(super) struct Bounded<T, const MAX: usize>(pub(super) Vec<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Deserialize<'de> for Bounded<T, MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(BoundedVisitor::<T, MAX>(PhantomData))
    }
}

struct BoundedVisitor<T, const MAX: usize>(PhantomData<T>);

impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for BoundedVisitor<T, MAX> {
    type Value = Bounded<T, MAX>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array")
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Self::Value, S::Error> {
        let too_many = || de::Error::custom(format!("at most {MAX} entries"));
        if seq.size_hint().is_some_and(|n| n > MAX) {
            return Err(too_many());
        }
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            if items.len() == MAX {
                return Err(too_many());
            }
            items.push(item);
        }
        Ok(Bounded(items))
    }
}

fn valid_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}
