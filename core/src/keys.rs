//! Stable ids for accounts and tenants, and the short shared-data keys built from them.
//!
//! Credentials are reduced to a 64-bit FNV-1a hash the moment they are read; only the hash is
//! ever stored or exported. FNV-1a is stable across workers, restarts and versions, so an
//! operator can compute the id of a key they hold (`python3 -c` one-liner in docs/), and an API
//! key's entropy makes the hash useless for recovering it.

use crate::classify::find;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME)
    })
}

/// The id of "no credential": requests without any account header share it.
pub const NO_ACCOUNT: u64 = 0;

/// The id of "model not named": requests whose path and body name none share it (as `-`).
pub const NO_MODEL: u64 = 0;

/// One id from two, for keys made of a header's value and a model: FNV-1a over both ids'
/// bytes, so (a, b) and (b, a) differ.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&a.to_le_bytes());
    bytes[8..].copy_from_slice(&b.to_le_bytes());
    fnv1a64(&bytes)
}

/// The model a request path names: Azure's deployment (`/openai/deployments/{name}/...`) or
/// Gemini's model (`/v1beta/models/{model}:generateContent`). Other dialects name it in the
/// body.
pub fn model_in_path(path: &[u8]) -> Option<&[u8]> {
    let path = path.split(|b| *b == b'?').next().unwrap_or(path);
    let (marker, ends): (&[u8], &[u8]) = if let Some(i) = find(path, b"/deployments/") {
        (&path[i + b"/deployments/".len()..], b"/")
    } else {
        let i = find(path, b"/models/")?;
        (&path[i + b"/models/".len()..], b"/:")
    };
    let end = marker
        .iter()
        .position(|b| ends.contains(b))
        .unwrap_or(marker.len());
    Some(&marker[..end]).filter(|m| !m.is_empty())
}

/// Shared-data key of the cooldown of (pool, account).
pub fn cooldown_key(pool: &str, account: u64) -> String {
    key("c:", pool, key_id_hex(account))
}

/// Shared-data key of one token bucket of a limit.
pub fn bucket_key(limit: &str, key_id: u64) -> String {
    key("b:", limit, key_id_hex(key_id))
}

/// `{kind}{name}:{id}` without the formatting machinery (this runs on every request).
fn key(kind: &str, name: &str, id: [u8; 16]) -> String {
    let mut out = String::with_capacity(kind.len() + name.len() + 17);
    out.push_str(kind);
    out.push_str(name);
    out.push(':');
    // Hex digits are ASCII: the check is 16 compares, and the fallback never runs.
    out.push_str(std::str::from_utf8(&id).unwrap_or("-"));
    out
}

/// `{:016x}` of an id.
fn key_id_hex(id: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = HEX[((id >> (60 - 4 * i)) & 0xf) as usize];
    }
    out
}

/// Shared-data key of the `max_in_flight` slots of one key of a limit.
pub fn slots_key(limit: &str, key_id: u64) -> String {
    key("f:", limit, key_id_hex(key_id))
}

/// The bucket that keys past `max_keys` share.
pub fn overflow_bucket_key(limit: &str) -> String {
    format!("b:{limit}:~")
}

/// Shared-data keys counting the distinct bucket keys and cooldown keys created so far. Two
/// separate budgets, each bounded by `max_keys`: tenant ids are whatever clients send, and a
/// flood of them must not use up the room that cooldowns of real accounts need.
pub const BUCKET_KEY_COUNT: &str = "k:b";
pub const COOLDOWN_KEY_COUNT: &str = "k:c";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_named_in_paths() {
        let cases: [(&[u8], Option<&[u8]>); 7] = [
            (
                b"/openai/deployments/gpt4o-prod/chat/completions?api-version=2024-10-21",
                Some(b"gpt4o-prod"),
            ),
            (
                b"/v1beta/models/gemini-2.0-flash:generateContent",
                Some(b"gemini-2.0-flash"),
            ),
            (
                b"/v1beta/models/gemini-pro:streamGenerateContent?alt=sse",
                Some(b"gemini-pro"),
            ),
            (b"/v1/chat/completions", None),
            (b"/v1/models/", None),
            (b"/openai/deployments/", None),
            (b"/x?q=/models/a", None),
        ];
        for (path, want) in cases {
            assert_eq!(
                model_in_path(path),
                want,
                "{}",
                String::from_utf8_lossy(path)
            );
        }
        assert_ne!(mix(1, 2), mix(2, 1));
    }

    #[test]
    fn keys_are_the_formatted_ids() {
        for id in [0, 1, 0xdead_beef, u64::MAX, 0x0123_4567_89ab_cdef] {
            assert_eq!(cooldown_key("openai", id), format!("c:openai:{id:016x}"));
            assert_eq!(bucket_key("t", id), format!("b:t:{id:016x}"));
            assert_eq!(slots_key("cap", id), format!("f:cap:{id:016x}"));
        }
    }

    #[test]
    fn fnv_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
