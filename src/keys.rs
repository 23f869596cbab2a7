//! Stable ids for accounts and tenants, and the short shared-data keys built from them.
//!
//! Credentials are reduced to a 64-bit FNV-1a hash the moment they are read; only the hash is
//! ever stored or exported. FNV-1a is stable across workers, restarts and versions, so an
//! operator can compute the id of a key they hold (`python3 -c` one-liner in docs/), and an API
//! key's entropy makes the hash useless for recovering it.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME)
    })
}

/// The id of "no credential": requests without any account header share it.
pub const NO_ACCOUNT: u64 = 0;

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
    out.extend(id.iter().map(|b| char::from(*b)));
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
