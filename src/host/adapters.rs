//! The pure core's traits implemented over hostcalls.

use super::abi;
use llm_governor_core::config::Config;
use llm_governor_core::metrics::{self, Counter, Gauge, Histogram, Metrics};
use llm_governor_core::store::{SharedStore, StoreError};
use proxy_wasm::types::{MetricType, Status};

/// Envoy shared data.
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        abi::get_shared(key).map_err(|e| StoreError::Host(e.to_string()))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match abi::set_shared(key, value, cas.unwrap_or(0)) {
            Ok(()) => Ok(()),
            Err(abi::HostError(Status::CasMismatch)) => Err(StoreError::CasMismatch),
            Err(e) => Err(StoreError::Host(e.to_string())),
        }
    }
}

/// Metric ids of one pool; None where the host refused to define one.
struct PoolMetrics {
    counters: Vec<Option<u32>>,
    gauges: Vec<Option<u32>>,
    histograms: Vec<Option<u32>>,
}

/// Envoy stats, defined once per VM for every configured pool.
pub struct HostMetrics {
    pools: Vec<PoolMetrics>,
}

impl HostMetrics {
    pub fn define(cfg: &Config) -> HostMetrics {
        let define = |kind: MetricType, pool: &str, name: &str| {
            let full = metrics::stat_name(pool, name);
            abi::define_metric(kind, &full)
                .map_err(|e| log::warn!("llm_governor: could not define stat {full}: {e}"))
                .ok()
        };
        let pools = cfg
            .pools
            .iter()
            .map(|p| PoolMetrics {
                counters: Counter::ALL
                    .iter()
                    .map(|c| define(MetricType::Counter, &p.name, c.name()))
                    .collect(),
                gauges: Gauge::ALL
                    .iter()
                    .map(|g| define(MetricType::Gauge, &p.name, g.name()))
                    .collect(),
                histograms: Histogram::ALL
                    .iter()
                    .map(|h| define(MetricType::Histogram, &p.name, h.name()))
                    .collect(),
            })
            .collect();
        HostMetrics { pools }
    }
}

impl Metrics for HostMetrics {
    fn count(&mut self, pool: usize, c: Counter) {
        if let Some(Some(id)) = self.pools.get(pool).and_then(|p| p.counters.get(c.index())) {
            let _ = abi::increment_metric(*id, 1);
        }
    }

    /// (The core's `GaugeCache` skips writes that repeat this worker's last value.)
    fn gauge(&mut self, pool: usize, g: Gauge, value: u64) {
        if let Some(Some(id)) = self.pools.get(pool).and_then(|p| p.gauges.get(g.index())) {
            let _ = abi::record_metric(*id, value);
        }
    }

    /// `proxy_increment_metric` adds to a gauge too: each worker moves the gauge by its own
    /// part, so the gauge is the sum over workers (a `record` would be last-writer-wins).
    fn add(&mut self, pool: usize, g: Gauge, delta: i64) {
        if let Some(Some(id)) = self.pools.get(pool).and_then(|p| p.gauges.get(g.index())) {
            let _ = abi::increment_metric(*id, delta);
        }
    }

    fn histogram(&mut self, pool: usize, h: Histogram, ms: u64) {
        if let Some(Some(id)) = self
            .pools
            .get(pool)
            .and_then(|p| p.histograms.get(h.index()))
        {
            let _ = abi::record_metric(*id, ms);
        }
    }
}

/// A seed for the worker's randomness from the host's entropy (getrandom → WASI
/// `random_get`), or from the clock if that fails.
pub fn seed() -> u64 {
    let mut seed = [0u8; 8];
    match getrandom::fill(&mut seed) {
        Ok(()) => u64::from_le_bytes(seed),
        Err(e) => {
            log::warn!("llm_governor: getrandom failed ({e}); seeding jitter from the clock");
            abi::now_ms().wrapping_mul(0x9E37_79B9_7F4A_7C15)
        }
    }
}

/// Routes the `log` crate to Envoy's log.
pub struct HostLogger;

impl log::Log for HostLogger {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        let level = match record.level() {
            log::Level::Trace => 0,
            log::Level::Debug => 1,
            log::Level::Info => 2,
            log::Level::Warn => 3,
            log::Level::Error => 4,
        };
        abi::log(level, &record.args().to_string());
    }

    fn flush(&self) {}
}
