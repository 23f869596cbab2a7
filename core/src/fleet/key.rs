//! A (pool, account) as the fleet's service knows it: whose turn (`turn`), whose cooldown
//! marker (`watch`).

use crate::config::Config;
use crate::keys;
use crate::request::Flow;

/// Whose turn: a (pool, account) as the flow is governed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnKey {
    pub pool: usize,
    pub account: u64,
}

impl TurnKey {
    pub fn of(flow: &Flow) -> TurnKey {
        TurnKey {
            pool: flow.pool,
            account: flow.account,
        }
    }

    /// The descriptor's key: the pool's name and its account label, or the account's keyed id
    /// (never a credential).
    pub fn descriptor_key(&self, cfg: &Config) -> String {
        let pool = &cfg.pools[self.pool];
        match &pool.account {
            Some(label) => format!("{}/{label}", pool.name),
            None => format!("{}/{}", pool.name, keys::id_hex(self.account)),
        }
    }
}
