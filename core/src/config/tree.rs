//! The parsed JSON as a serde deserializer with this configuration's rules. serde_json's own
//! (`&Value`) would take an array for a struct and visit an object's keys in sorted order;
//! this one takes only an object for a struct, refuses an unknown field before it looks at any
//! value, visits fields in the order the DTO declares them, and treats a null field as absent.
//! It refuses unknown fields from the list the derive hands it, so the DTOs'
//! `deny_unknown_fields` states the same rule for any other deserializer. It also reports the
//! path itself: each level adds its segment to an error on its way out, which costs less module
//! size than wrapping it in `serde_path_to_error` (about 12 KiB).

use super::model::ConfigError;
use super::values::Raw;
use serde::de::value::MapDeserializer;
use serde::de::{self, DeserializeSeed, Deserializer, IntoDeserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;
use std::fmt;

/// What went wrong and where: `path` grows at each level the error passes on its way out.
#[derive(Debug)]
pub(super) struct DeError {
    path: String,
    reason: String,
}

impl DeError {
    // Errors are the cold path: one copy of each constructor, not one per DTO field.
    #[inline(never)]
    fn under(mut self, segment: Segment) -> Self {
        let rest = std::mem::take(&mut self.path);
        let sep = if rest.is_empty() || rest.starts_with('[') {
            ""
        } else {
            "."
        };
        self.path = match segment {
            Segment::Key(key) => format!("{key}{sep}{rest}"),
            Segment::Index(i) => format!("[{i}]{sep}{rest}"),
        };
        self
    }
}

enum Segment<'a> {
    Key(&'a str),
    Index(usize),
}

impl fmt::Display for DeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

impl std::error::Error for DeError {}

impl From<DeError> for ConfigError {
    fn from(e: DeError) -> ConfigError {
        ConfigError {
            field: e.path,
            reason: e.reason,
        }
    }
}

impl de::Error for DeError {
    #[inline(never)]
    fn custom<T: fmt::Display>(msg: T) -> Self {
        DeError {
            path: String::new(),
            reason: msg.to_string(),
        }
    }

    #[inline(never)]
    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        DeError {
            path: field.to_string(),
            reason: format!("unknown field (expected one of: {})", expected.join(", ")),
        }
    }
}

/// A present value, or `&NULL` for a field the object does not have (null is absent).
#[derive(Clone, Copy)]
pub(super) struct Tree<'a>(pub(super) &'a Value);

static NULL: Value = Value::Null;

impl<'de> IntoDeserializer<'de, DeError> for Tree<'de> {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

impl<'de> Deserializer<'de> for Tree<'de> {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => visitor.visit_u64(u),
                (None, Some(i), _) => visitor.visit_i64(i),
                (None, None, f) => visitor.visit_f64(f.unwrap_or(f64::NAN)),
            },
            Value::String(s) => visitor.visit_borrowed_str(s),
            Value::Array(_) => visitor.visit_seq(Items::array(self.0)?),
            // Only leaves (`Raw`) ask for an object this way, and they look at nothing inside.
            Value::Object(map) => visitor.visit_map(MapDeserializer::new(
                map.iter().map(|(k, v)| (k.as_str(), Tree(v))),
            )),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        visitor.visit_seq(Items::fields(self.0, fields)?)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        visitor.visit_seq(Items::array(self.0)?)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, DeError> {
        visitor.visit_newtype_struct(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct tuple tuple_struct map enum identifier ignored_any
    }
}

/// The entries of an array, or the fields of a struct; an error in one gets its segment.
struct Items<'a>(std::vec::IntoIter<(Segment<'static>, &'a Value)>);

// Out of line, and not generic: one copy serves every DTO.
impl<'a> Items<'a> {
    #[inline(never)]
    fn array(v: &'a Value) -> Result<Self, DeError> {
        let Value::Array(items) = v else {
            return Err(de::Error::custom(format!(
                "must be an array, got {}",
                kind(v)
            )));
        };
        let values: Vec<_> = items
            .iter()
            .enumerate()
            .map(|(i, v)| (Segment::Index(i), v))
            .collect();
        Ok(Items(values.into_iter()))
    }

    /// A struct is visited as the sequence of its declared fields, absent ones as null: the
    /// order is the DTO's, and the derived code has no keys to match or duplicates to catch.
    #[inline(never)]
    fn fields(v: &'a Value, fields: &'static [&'static str]) -> Result<Self, DeError> {
        let Value::Object(map) = v else {
            return Err(de::Error::custom(format!(
                "must be an object, got {}",
                kind(v)
            )));
        };
        if let Some(unknown) = map.keys().find(|k| !fields.contains(&k.as_str())) {
            return Err(de::Error::unknown_field(unknown, fields));
        }
        let values: Vec<_> = fields
            .iter()
            .map(|f| (Segment::Key(f), map.get(*f).unwrap_or(&NULL)))
            .collect();
        Ok(Items(values.into_iter()))
    }
}

impl<'de> SeqAccess<'de> for Items<'de> {
    type Error = DeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, DeError> {
        let Some((at, value)) = self.0.next() else {
            return Ok(None);
        };
        seed.deserialize(Tree(value))
            .map(Some)
            .map_err(|e| e.under(at))
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// What a value is, in the words a leaf uses when it refuses one (`Raw::kind`).
fn kind(v: &Value) -> &'static str {
    // Read as a leaf reads it, which cannot fail: a leaf looks inside no array or object.
    Raw::deserialize(Tree(v)).map_or("a value", Raw::kind)
}
