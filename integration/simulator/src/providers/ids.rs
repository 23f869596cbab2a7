//! Random ids in the shapes providers give requests and messages.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

fn rand_u64() -> u64 {
    static CTR: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(CTR.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

pub fn rand_alnum(n: usize) -> String {
    const CHARS: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut out = String::with_capacity(n);
    let mut x = rand_u64();
    for i in 0..n {
        if i % 10 == 0 && i > 0 {
            x = rand_u64();
        }
        out.push(CHARS[(x % 62) as usize] as char);
        x /= 62;
    }
    out
}

pub fn uuid() -> String {
    let a = rand_u64();
    let b = rand_u64();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        ((b >> 48) & 0x3fff) | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert_eq!(rand_alnum(29).len(), 29);
        assert_ne!(rand_alnum(16), rand_alnum(16));
        assert_eq!(uuid().len(), 36);
    }
}
