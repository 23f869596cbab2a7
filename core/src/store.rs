//! Shared data as Envoy implements it, behind a trait, plus an in-memory twin for tests.
//!
//! Host semantics this code is written against (Envoy `SharedData`): one process-wide map per
//! vm_id; `get` copies the value and returns its CAS token; `set` with a token fails with
//! `CasMismatch` if the entry changed since; `set` without a token, or on a missing key,
//! always succeeds, so there is no insert-if-absent; nothing is ever deleted.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    CasMismatch,
    Host(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::CasMismatch => write!(f, "shared data changed concurrently (CAS mismatch)"),
            StoreError::Host(s) => write!(f, "shared data: {s}"),
        }
    }
}

pub trait SharedStore {
    /// The value and its CAS token, or None when the key was never set.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    /// Write `value`; with `cas`, only if the entry is unchanged since that token was read.
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

/// How many read-modify-write attempts before giving up. Each attempt is two copies under
/// Envoy's shared-data lock; past a handful, the key is hot enough that giving up (and
/// counting it) beats spinning on the request path.
pub const MAX_CAS_ATTEMPTS: u32 = 8;

/// The result of a bounded compare-and-swap update.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Updated<T> {
    pub value: T,
    /// CAS conflicts met on the way (0 when uncontended).
    pub conflicts: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateError {
    /// Every attempt met a concurrent writer.
    Contended,
    Host(String),
}

/// Read-modify-write `key` under CAS. `step` gets the current bytes (None when missing) and
/// returns the bytes to write (None: leave as is) and a result. A missing key is first written
/// with `init`, unconditionally, and the update is then done under CAS against that: two
/// workers creating the same key at once can then lose at most the one update that raced the
/// creation, instead of every update made before the second creation.
pub fn update<T>(
    store: &dyn SharedStore,
    key: &str,
    init: Option<&[u8]>,
    step: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
) -> Result<Updated<T>, UpdateError> {
    update_from(store, key, None, init, step)
}

/// A fixed-width value kept under one key (little-endian fields at fixed offsets, documented
/// by each record). Bytes that are not one (a wrong length) read as none.
pub trait Record: Sized {
    fn to_bytes(&self) -> Vec<u8>;
    fn from_bytes(bytes: &[u8]) -> Option<Self>;
}

/// `update_from` over a typed record: `step` sees the record (None when the key is missing or
/// holds no such record) and returns the record to write (None: leave it) and a result. A
/// missing key is first written as `init`, as `update` does.
pub fn modify<R: Record, T>(
    store: &dyn SharedStore,
    key: &str,
    known: Option<(Vec<u8>, u32)>,
    init: Option<&R>,
    mut step: impl FnMut(Option<R>) -> (Option<R>, T),
) -> Result<Updated<T>, UpdateError> {
    let init = init.map(R::to_bytes);
    update_from(store, key, known, init.as_deref(), |cur| {
        let (write, value) = step(cur.and_then(R::from_bytes));
        (write.map(|r| r.to_bytes()), value)
    })
}

/// Writes a record's fields in order, little-endian, into its `N` bytes.
pub struct Writer<const N: usize> {
    out: [u8; N],
    at: usize,
}

impl<const N: usize> Default for Writer<N> {
    fn default() -> Self {
        Writer { out: [0; N], at: 0 }
    }
}

impl<const N: usize> Writer<N> {
    fn put<const K: usize>(mut self, bytes: [u8; K]) -> Self {
        if let Some(dst) = self.out.get_mut(self.at..self.at + K) {
            dst.copy_from_slice(&bytes);
        }
        self.at += K;
        self
    }

    pub fn u8(self, v: u8) -> Self {
        self.put([v])
    }
    pub fn u16(self, v: u16) -> Self {
        self.put(v.to_le_bytes())
    }
    pub fn u32(self, v: u32) -> Self {
        self.put(v.to_le_bytes())
    }
    pub fn u64(self, v: u64) -> Self {
        self.put(v.to_le_bytes())
    }
    pub fn i64(self, v: i64) -> Self {
        self.put(v.to_le_bytes())
    }

    pub fn done(self) -> [u8; N] {
        debug_assert_eq!(self.at, N, "a record's fields fill it exactly");
        self.out
    }
}

/// Reads a record's fields back in the order they were written; None past the end.
pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader of `bytes` if they are exactly `len` long: a value this code did not write (a
    /// wrong length) is not trusted.
    pub fn exact(bytes: &'a [u8], len: usize) -> Option<Reader<'a>> {
        (bytes.len() == len).then_some(Reader { bytes })
    }

    fn take<const K: usize>(&mut self) -> Option<[u8; K]> {
        let (head, rest) = self.bytes.split_first_chunk::<K>()?;
        self.bytes = rest;
        Some(*head)
    }

    pub fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|[b]| b)
    }
    pub fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    pub fn i64(&mut self) -> Option<i64> {
        self.take().map(i64::from_le_bytes)
    }
}

/// A count kept as 8 little-endian bytes (the key counts of `keyspace`).
impl Record for u64 {
    fn to_bytes(&self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }

    fn from_bytes(bytes: &[u8]) -> Option<u64> {
        bytes.try_into().ok().map(u64::from_le_bytes)
    }
}

/// `update`, starting from a value (and CAS token) the caller has just read, which saves one
/// copy under Envoy's shared-data lock on the request path.
pub fn update_from<T>(
    store: &dyn SharedStore,
    key: &str,
    mut known: Option<(Vec<u8>, u32)>,
    init: Option<&[u8]>,
    mut step: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
) -> Result<Updated<T>, UpdateError> {
    let mut conflicts = 0;
    for _ in 0..MAX_CAS_ATTEMPTS {
        let current = match known.take() {
            Some(v) => Some(v),
            None => store
                .get(key)
                .map_err(|e| UpdateError::Host(e.to_string()))?,
        };
        let (bytes, cas) = match current {
            Some((b, cas)) => (Some(b), Some(cas)),
            None => match init {
                Some(init) => {
                    store
                        .set(key, init, None)
                        .map_err(|e| UpdateError::Host(e.to_string()))?;
                    continue;
                }
                None => (None, None),
            },
        };
        let (write, value) = step(bytes.as_deref());
        let Some(write) = write else {
            return Ok(Updated { value, conflicts });
        };
        match store.set(key, &write, cas) {
            Ok(()) => return Ok(Updated { value, conflicts }),
            Err(StoreError::CasMismatch) => conflicts += 1,
            Err(e) => return Err(UpdateError::Host(e.to_string())),
        }
    }
    Err(UpdateError::Contended)
}

/// In-memory store with Envoy's semantics, safe to share between threads, with injectable
/// CAS conflicts for tests.
#[derive(Default)]
pub struct MemStore {
    map: Mutex<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: AtomicU32,
    /// The next N conditional sets fail with CasMismatch, as if another worker wrote first.
    pub inject_conflicts: AtomicU32,
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every key and value, for tests that check what is stored.
    pub fn dump(&self) -> Vec<(String, Vec<u8>)> {
        self.map
            .lock()
            .map(|m| m.iter().map(|(k, (v, _))| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }
}

impl SharedStore for MemStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        let map = self
            .map
            .lock()
            .map_err(|_| StoreError::Host("poisoned".into()))?;
        Ok(map.get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self
            .map
            .lock()
            .map_err(|_| StoreError::Host("poisoned".into()))?;
        if let (Some(cas), Some((_, current))) = (cas, map.get(key)) {
            let injected = self
                .inject_conflicts
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if injected || cas != *current {
                return Err(StoreError::CasMismatch);
            }
        }
        // Envoy's tokens come from a process-wide counter and are never 0.
        let token = self
            .next_cas
            .fetch_add(1, Ordering::SeqCst)
            .wrapping_add(1)
            .max(1);
        map.insert(key.to_string(), (value.to_vec(), token));
        Ok(())
    }
}
