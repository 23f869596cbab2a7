//! The pure core's traits implemented over hostcalls.

use super::abi;
use llm_governor_core::config::Config;
use llm_governor_core::keys::HashKey;
use llm_governor_core::metrics::{self, Catalogue, Kind, StatWriter, Write};
use llm_governor_core::store::{SharedStore, StoreError};
use proxy_wasm::types::{MetricType, Status};

/// Envoy shared data.
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        abi::get_shared(key).map_err(|e| StoreError::Host(format!("{e:?}")))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        abi::set_shared(key, value, cas.unwrap_or(0)).map_err(|e| match e {
            Status::CasMismatch => StoreError::CasMismatch,
            e => StoreError::Host(format!("{e:?}")),
        })
    }
}

/// Envoy stats: one per pool and stat (`llm_governor.pool.<pool>.<stat>`), and with
/// `hold.classes` one per pool, class and class stat
/// (`llm_governor.pool.<pool>.class.<class>.<stat>`), defined once per VM.
pub fn define_stats(cfg: &Config) -> Catalogue<u32> {
    let pools = || cfg.pools.iter().map(|p| p.name.as_str());
    let catalogue = Catalogue::define(pools(), |kind, pool, stat| {
        define(kind, metrics::stat_name(pool, stat))
    });
    catalogue.define_classes(
        pools(),
        &cfg.hold.stat_classes(),
        |kind, pool, class, stat| define(kind, metrics::class_stat_name(pool, class, stat)),
    )
}

fn define(kind: Kind, name: String) -> Option<u32> {
    let kind = match kind {
        Kind::Counter => MetricType::Counter,
        Kind::Gauge => MetricType::Gauge,
        Kind::Histogram => MetricType::Histogram,
    };
    abi::define_metric(kind, &name)
        .map_err(|e| log::warn!("llm_governor: could not define stat {name}: {e:?}"))
        .ok()
}

/// Writes stats by hostcall. `proxy_increment_metric` adds to a gauge too: each worker moves
/// a gauge by its own part, so the gauge is the sum over workers.
pub struct HostStats;

impl StatWriter<u32> for HostStats {
    fn write(&mut self, _pool: usize, id: u32, write: Write) {
        let _ = match write {
            Write::Count => abi::increment_metric(id, 1),
            Write::Move(delta) => abi::increment_metric(id, delta),
            Write::Set(v) | Write::Record(v) => abi::record_metric(id, v),
        };
    }
}

/// A seed for the worker's randomness from the host's entropy (getrandom → WASI
/// `random_get`), or from the clock if that fails.
pub fn seed() -> u64 {
    let mut seed = [0u8; 8];
    if let Err(e) = getrandom::fill(&mut seed) {
        log::warn!("llm_governor: getrandom failed ({e}); seeding from the clock");
        return abi::now_ms().wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    u64::from_le_bytes(seed)
}

/// The key of the ids over Envoy shared data: the VM sees `LLM_GOVERNOR_HASH_KEY` when
/// `vm_config.environment_variables.host_env_keys` names it.
pub fn hash_key() -> HashKey {
    HashKey::for_host(&HostStore, seed)
}

/// Routes the `log` crate to Envoy's log.
pub struct HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        // `log` counts Error 1 .. Trace 5; proxy-wasm Trace 0 .. Error 4.
        abi::log(5 - record.level() as u32, &record.args().to_string());
    }

    fn flush(&self) {}
}
