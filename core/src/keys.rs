//! Ids for accounts, tenants and models, and the short shared-data keys built from them.
//!
//! Credentials, tenant ids and models are reduced to a 64-bit keyed hash (SipHash-2-4 under a
//! secret `HashKey`) the moment they are read; only the id is ever stored or exported. A keyed
//! hash because these values are whatever clients send: with an unkeyed one (FNV-1a, used here
//! before), whoever picks a tenant id could compute one that collides with another tenant's and
//! drain its budget, or cool another account. Without the key, no one can.

use crate::classify::find;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME)
    })
}

/// The environment variable an operator's secret for the ids comes from: set it to the same
/// value for every Envoy of a fleet. Hosts read it from their environment (the wasm VM only sees
/// the variables its `vm_config.environment_variables.host_env_keys` names).
pub const SECRET_ENV: &str = "LLM_GOVERNOR_HASH_KEY";

/// The shortest secret accepted: 16 bytes.
pub const MIN_SECRET: usize = 16;

/// The secret key of the ids: the same in every worker of an Envoy (and every Envoy of a
/// fleet), never logged or exported (its `Debug` shows nothing of it).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HashKey([u64; 2]);

impl std::fmt::Debug for HashKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HashKey(..)")
    }
}

impl HashKey {
    /// A key from two random words (a host's entropy).
    pub fn from_words(k0: u64, k1: u64) -> HashKey {
        HashKey([k0, k1])
    }

    /// A key from an operator's secret; None when it is shorter than `MIN_SECRET` bytes.
    pub fn from_secret(secret: &[u8]) -> Option<HashKey> {
        (secret.len() >= MIN_SECRET)
            .then(|| HashKey([siphash24([0, 1], secret), siphash24([2, 3], secret)]))
    }

    /// The key a host uses: from the operator's secret (`SECRET_ENV`, when set and long
    /// enough), else `own()`, the host's random key for this Envoy. Says which in the log,
    /// never the key.
    pub fn choose(secret: Option<&[u8]>, own: impl FnOnce() -> HashKey) -> HashKey {
        match secret.map(HashKey::from_secret) {
            Some(Some(key)) => {
                log::info!("llm_governor: ids are keyed with {SECRET_ENV}");
                return key;
            }
            Some(None) => log::warn!(
                "llm_governor: {SECRET_ENV} is shorter than {MIN_SECRET} bytes and is ignored: \
                 ids are keyed with this Envoy's own random key"
            ),
            None => {}
        }
        own()
    }

    /// The key of the ids for one Envoy, as every host finds it: the operator's `secret` (see
    /// `choose`), else the key kept in the Envoy's shared `store`, else a `fresh()` one written
    /// there first. The first configuration to run writes it (in proxy-wasm the main thread's
    /// VM, before any worker's) and every later one reads it (two racing on a missing key could
    /// each keep their own, which is why the first writer goes alone).
    pub fn for_envoy(
        store: &dyn crate::store::SharedStore,
        secret: Option<&[u8]>,
        fresh: impl FnOnce() -> HashKey,
    ) -> HashKey {
        let stored = || {
            let (bytes, _) = store.get(KEY_OF_IDS).ok()??;
            HashKey::from_bytes(&bytes)
        };
        HashKey::choose(secret, || {
            stored().unwrap_or_else(|| {
                let mine = fresh();
                let _ = store.set(KEY_OF_IDS, &mine.to_bytes(), None);
                stored().unwrap_or(mine)
            })
        })
    }

    /// The key of the ids of an Envoy whose workers share `store`: `LLM_GOVERNOR_HASH_KEY`
    /// (`SECRET_ENV`) from the process's environment when set, else one random key per Envoy
    /// drawn from `seed` (`for_envoy`). Both hosts take their key here.
    pub fn for_host(
        store: &dyn crate::store::SharedStore,
        mut seed: impl FnMut() -> u64,
    ) -> HashKey {
        let secret = std::env::var(SECRET_ENV).ok();
        HashKey::for_envoy(store, secret.as_deref().map(str::as_bytes), || {
            HashKey::from_words(seed(), seed())
        })
    }

    /// The key as 16 bytes, for a host that keeps one key for all its workers; `from_bytes`
    /// reads it back.
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.0[0].to_le_bytes());
        b[8..].copy_from_slice(&self.0[1].to_le_bytes());
        b
    }

    pub fn from_bytes(b: &[u8]) -> Option<HashKey> {
        let word = |r: std::ops::Range<usize>| Some(u64::from_le_bytes(b.get(r)?.try_into().ok()?));
        (b.len() == 16)
            .then(|| Some(HashKey([word(0..8)?, word(8..16)?])))
            .flatten()
    }

    /// The id of `bytes` under this key.
    pub fn id(&self, bytes: &[u8]) -> u64 {
        siphash24(self.0, bytes)
    }

    /// One id from two, for keys made of a header's value and a model; (a, b) and (b, a)
    /// differ.
    pub fn mix(&self, a: u64, b: u64) -> u64 {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&a.to_le_bytes());
        bytes[8..].copy_from_slice(&b.to_le_bytes());
        self.id(&bytes)
    }
}

/// SipHash-2-4 (Aumasson and Bernstein): a keyed 64-bit PRF, built for exactly this (hash
/// tables keyed against chosen inputs).
fn siphash24(key: [u64; 2], bytes: &[u8]) -> u64 {
    let mut v = [
        key[0] ^ 0x736f_6d65_7073_6575,
        key[1] ^ 0x646f_7261_6e64_6f6d,
        key[0] ^ 0x6c79_6765_6e65_7261,
        key[1] ^ 0x7465_6462_7974_6573,
    ];
    let round = |v: &mut [u64; 4]| {
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13) ^ v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16) ^ v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21) ^ v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17) ^ v[2];
        v[2] = v[2].rotate_left(32);
    };
    let compress = |v: &mut [u64; 4], m: u64| {
        v[3] ^= m;
        round(v);
        round(v);
        v[0] ^= m;
    };
    let mut words = bytes.chunks_exact(8);
    for w in words.by_ref() {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        compress(&mut v, u64::from_le_bytes(b));
    }
    let mut last = [0u8; 8];
    let rest = words.remainder();
    last[..rest.len()].copy_from_slice(rest);
    last[7] = bytes.len() as u8;
    compress(&mut v, u64::from_le_bytes(last));
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

/// The id of "no credential": requests without any account header share it.
pub const NO_ACCOUNT: u64 = 0;

/// The id of "model not named": requests whose path and body name none share it (as `-`).
pub const NO_MODEL: u64 = 0;

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

/// Shared-data key of the board on which the workers holding requests of (pool, account)
/// share whose turn it is (`hold::board`).
pub fn board_key(pool: &str, account: u64) -> String {
    key("h:", pool, key_id_hex(account))
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

/// An id as 16 hex digits: how a credential's id goes to the fleet's service.
pub fn id_hex(id: u64) -> String {
    key_id_hex(id).iter().map(|&b| char::from(b)).collect()
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

/// Shared-data key of the prompt prefixes an (account, model) has in the provider's cache.
pub fn prefixes_key(account: u64, model: u64) -> String {
    let account = key_id_hex(account);
    key(
        "p:",
        std::str::from_utf8(&account).unwrap_or("-"),
        key_id_hex(model),
    )
}

/// Shared-data key of the recent usage of a (pool, model), what its predictions learn from.
pub fn usage_key(pool: &str, model: u64) -> String {
    key("u:", pool, key_id_hex(model))
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
/// Where an Envoy's own key of the ids is kept (shared data is never exported).
pub const KEY_OF_IDS: &str = "k:h";
pub const COOLDOWN_KEY_COUNT: &str = "k:c";
/// Counts the boards of held requests' turns (`board_key`), within `max_keys` too.
pub const BOARD_KEY_COUNT: &str = "k:o";
/// The Envoy's record of the fleet's cooling marker (`fleet::watch::Marker`), one key.
pub const MARKER_KEY: &str = "w:fleet";

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
        let k = HashKey::from_words(1, 2);
        assert_ne!(k.mix(1, 2), k.mix(2, 1));
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
    #[allow(deprecated)] // std's SipHasher is SipHash-2-4: the reference to check against
    fn siphash_matches_the_reference_for_every_length() {
        use std::hash::Hasher;
        let data: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
        for (k0, k1) in [
            (0, 0),
            (0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908),
            (u64::MAX, 7),
        ] {
            for len in 0..data.len() {
                let mut reference = std::hash::SipHasher::new_with_keys(k0, k1);
                reference.write(&data[..len]);
                assert_eq!(
                    siphash24([k0, k1], &data[..len]),
                    reference.finish(),
                    "{len}"
                );
            }
        }
        // The paper's test vector: key 00..0f, message 00..0e.
        let msg: Vec<u8> = (0..15).collect();
        assert_eq!(
            siphash24([0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908], &msg),
            0xa129_ca61_49be_45e5
        );
    }

    #[test]
    fn a_key_is_never_shown() {
        let k = HashKey::from_secret(b"correct horse battery staple").unwrap();
        assert_eq!(format!("{k:?}"), "HashKey(..)");
        assert_ne!(
            Some(k),
            HashKey::from_secret(b"correct horse battery stapler")
        );
        assert_eq!(HashKey::from_secret(b"fifteen bytes.."), None, "too short");
        assert_eq!(HashKey::from_bytes(&k.to_bytes()), Some(k));
        assert_eq!(HashKey::from_bytes(&[0; 15]), None);
        let own = HashKey::from_words(1, 2);
        assert_eq!(HashKey::choose(None, || own), own);
        assert_eq!(HashKey::choose(Some(b"short"), || own), own);
        assert_eq!(
            HashKey::choose(Some(b"correct horse battery staple"), || own),
            k
        );
    }

    #[test]
    fn fnv_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
