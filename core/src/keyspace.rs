//! Bounded key creation in shared data, and what a failed store update costs. Tenant ids and
//! accounts are whatever clients send: every new key is counted against `max_keys`.

use crate::env::Env;
use crate::metrics::Counter;
use crate::store::{self, Record, UpdateError};

/// A store update gave up (contention) or failed: counted, and logged when the host failed.
pub(crate) fn store_failed(pool: usize, key: &str, e: &UpdateError, env: &mut Env) {
    env.metrics.count(pool, Counter::StoreContention);
    if let UpdateError::Host(msg) = e {
        log::warn!(
            "llm_governor: shared data update of {key} failed ({msg}); a request budget admits the request, a max_in_flight cap makes it wait"
        );
    }
}

/// `store::modify` on the request path: a failed update is counted against `pool` (see
/// `store_failed`) and gives None.
pub(crate) fn modify<R: Record, T>(
    env: &mut Env,
    pool: usize,
    key: &str,
    known: Option<(Vec<u8>, u32)>,
    init: Option<&R>,
    step: impl FnMut(Option<R>) -> (Option<R>, T),
) -> Option<T> {
    match store::modify(env.store, key, known, init, step) {
        Ok(u) => Some(u.value),
        Err(e) => {
            store_failed(pool, key, &e, env);
            None
        }
    }
}

/// True when `key` exists or the budget counted in `count_key` has room for one more key;
/// counts overflow otherwise.
pub(crate) fn key_exists_or_admit(
    max_keys: u64,
    key: &str,
    count_key: &str,
    pool: usize,
    env: &mut Env,
) -> bool {
    matches!(env.store.get(key), Ok(Some(_))) || admit_new_key(max_keys, count_key, pool, env)
}

/// Whether the budget counted in `count_key` has room for one more key of at most `max_keys`
/// (and count it); counts overflow otherwise.
pub(crate) fn admit_new_key(max_keys: u64, count_key: &str, pool: usize, env: &mut Env) -> bool {
    let admitted = store::modify(env.store, count_key, None, None, |n: Option<u64>| {
        let n = n.unwrap_or(0);
        if n >= max_keys {
            (None, false)
        } else {
            (Some(n + 1), true)
        }
    });
    // A contended count admits the key: the bound is then exceeded by at most the number of
    // racing workers, and memory stays bounded.
    let admitted = admitted.map_or(true, |u| u.value);
    if !admitted {
        env.metrics.count(pool, Counter::OverflowKeys);
    }
    admitted
}
