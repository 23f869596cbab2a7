//! The pure core's traits implemented over the dynamic-module callbacks and process memory.

use super::abi::{self, Body, ConfigHandle, MainThread, StatKind, StatOp, Stream};
use llm_governor_core::config::Config;
use llm_governor_core::metrics::{
    Catalogue, Counter, Family, Gauge, Histogram, Kind, Metrics, POOL_LABEL,
};
use llm_governor_core::store::MemStore;
use llm_governor_core::worker::StreamIo;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// What the workers share: process memory with the semantics of Envoy's shared data (CAS
/// tokens, no insert-if-absent, nothing deleted), so every test of the core against `MemStore`
/// holds here. One per process, as shared data is one per `vm_id`: it outlives a configuration
/// (a listener update keeps the buckets and cooldowns).
pub fn store() -> &'static MemStore {
    static STORE: OnceLock<MemStore> = OnceLock::new();
    STORE.get_or_init(MemStore::new)
}

/// Wall-clock milliseconds since the epoch (what proxy-wasm's clock gives the wasm host).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A seed for a worker's randomness from the kernel's entropy, or from the clock and std's
/// per-process random hasher keys if that fails.
pub fn seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::io::Read;
    let mut bytes = [0u8; 8];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_ok() {
        return u64::from_le_bytes(bytes);
    }
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_ms());
    h.finish()
}

/// A stat's id in Envoy and the value of its second label, if its family has one.
#[derive(Clone, Copy)]
pub struct StatId {
    id: usize,
    label: Option<&'static str>,
}

/// The core's catalogue over labelled families (`metrics::Family`): one family per stat kind,
/// defined once in `config_new` (the only place the ABI allows it), each pool a label value.
pub struct Stats {
    catalogue: Catalogue<StatId>,
    pools: Vec<String>,
    /// Whether every counter and gauge was made to exist (see `exist`).
    made: AtomicBool,
}

impl Stats {
    pub fn define(cfg: &ConfigHandle, config: &Config) -> Stats {
        let mut families: HashMap<&'static str, Option<usize>> = HashMap::new();
        let pools = config.pools.iter().map(|p| p.name.as_str());
        let catalogue = Catalogue::define(pools, |kind, _pool, stat| {
            let family = Family::of(stat);
            let id = *families.entry(family.name).or_insert_with(|| {
                let kind = match kind {
                    Kind::Counter => StatKind::Counter,
                    Kind::Gauge => StatKind::Gauge,
                    Kind::Histogram => StatKind::Histogram,
                };
                let labels: Vec<&str> = std::iter::once(POOL_LABEL)
                    .chain(family.label.map(|(name, _)| name))
                    .collect();
                let id = cfg.define(kind, family.name, &labels);
                if id.is_none() {
                    log::warn!("llm_governor: could not define stat {}", family.name);
                }
                id
            });
            id.map(|id| StatId {
                id,
                label: family.label.map(|(_, value)| value),
            })
        });
        let pools = config.pools.iter().map(|p| p.name.clone()).collect();
        Stats {
            catalogue,
            pools,
            made: AtomicBool::new(false),
        }
    }

    /// Make every counter and gauge of every pool exist, at 0, on the first stream: Envoy
    /// creates a labelled stat on its first write (and only a stream can write), while rate()
    /// and alerts want the series from the start. Histograms are left alone: a write would be
    /// a sample.
    pub fn exist(&self, s: Stream) {
        if self.made.swap(true, Ordering::Relaxed) {
            return;
        }
        let sink = self.on(s);
        for pool in 0..self.pools.len() {
            for c in Counter::ALL {
                sink.write(pool, self.catalogue.counter(pool, c), StatOp::Increment, 0);
            }
            for g in Gauge::ALL {
                sink.write(pool, self.catalogue.gauge(pool, g), StatOp::Raise, 0);
            }
        }
    }

    /// The sink for a call on stream `s` (Envoy finds the stats through the stream's filter).
    pub fn on(&self, s: Stream) -> Sink<'_> {
        Sink {
            stats: self,
            to: To::Stream(s),
        }
    }

    /// The sink for a call on the main thread, with no stream at hand (an owed call's answer).
    pub fn on_main<'a>(&'a self, main: &'a MainThread) -> Sink<'a> {
        Sink {
            stats: self,
            to: To::Main(main),
        }
    }
}

pub struct Sink<'a> {
    stats: &'a Stats,
    to: To<'a>,
}

/// What Envoy writes a stat through: a stream's filter (its worker thread), or the config
/// (the main thread).
enum To<'a> {
    Stream(Stream),
    Main(&'a MainThread),
}

impl Sink<'_> {
    fn write(&self, pool: usize, stat: Option<StatId>, op: StatOp, value: u64) {
        let (Some(stat), Some(name)) = (stat, self.stats.pools.get(pool)) else {
            return;
        };
        let labels: &[&str] = match stat.label {
            Some(label) => &[name, label],
            None => &[name],
        };
        match self.to {
            To::Stream(s) => s.stat(op, stat.id, labels, value),
            To::Main(main) => main.stat(op, stat.id, labels, value),
        }
    }
}

impl Metrics for Sink<'_> {
    fn count(&mut self, pool: usize, c: Counter) {
        self.write(
            pool,
            self.stats.catalogue.counter(pool, c),
            StatOp::Increment,
            1,
        );
    }

    /// (The core's `GaugeCache` skips writes that repeat this worker's last value.)
    fn gauge(&mut self, pool: usize, g: Gauge, value: u64) {
        self.write(
            pool,
            self.stats.catalogue.gauge(pool, g),
            StatOp::Set,
            value,
        );
    }

    /// Each worker moves the gauge by its own part, so the gauge is the sum over workers.
    fn add(&mut self, pool: usize, g: Gauge, delta: i64) {
        let op = if delta < 0 {
            StatOp::Lower
        } else {
            StatOp::Raise
        };
        let stat = self.stats.catalogue.gauge(pool, g);
        self.write(pool, stat, op, delta.unsigned_abs());
    }

    fn histogram(&mut self, pool: usize, h: Histogram, ms: u64) {
        self.write(
            pool,
            self.stats.catalogue.histogram(pool, h),
            StatOp::Record,
            ms,
        );
    }
}

/// Stats of a stream whose filter object is gone (its destroy hook): dropped.
pub struct Discard;

impl Metrics for Discard {
    fn count(&mut self, _: usize, _: Counter) {}
    fn gauge(&mut self, _: usize, _: Gauge, _: u64) {}
    fn add(&mut self, _: usize, _: Gauge, _: i64) {}
    fn histogram(&mut self, _: usize, _: Histogram, _: u64) {}
}

/// Stream buffers and attributes: the current stream's in a hook, a paused one's in a tick.
pub struct Io<'a> {
    pub current: (u32, Stream),
    pub paused: &'a HashMap<u32, Stream>,
}

impl Io<'_> {
    fn stream(&self, id: u32) -> Option<Stream> {
        if self.current.0 == id {
            return Some(self.current.1);
        }
        self.paused.get(&id).copied()
    }
}

impl StreamIo for Io<'_> {
    fn request_body(&mut self, id: u32, max: usize) -> Vec<u8> {
        let kinds = [Body::BufferedRequest, Body::ReceivedRequest];
        self.stream(id)
            .map_or_else(Vec::new, |s| s.body(&kinds, max))
    }

    fn response_body(&mut self, id: u32, max: usize) -> Vec<u8> {
        let kinds = [Body::BufferedResponse, Body::ReceivedResponse];
        self.stream(id)
            .map_or_else(Vec::new, |s| s.body(&kinds, max))
    }

    fn answered_by_upstream(&mut self, id: u32) -> bool {
        let details = self
            .stream(id)
            .and_then(|s| s.code_details_are(b"via_upstream"));
        details.unwrap_or(true)
    }
}

/// Routes the `log` crate to Envoy's log (logger `dynamic_modules`).
struct EnvoyLogger;

impl log::Log for EnvoyLogger {
    fn enabled(&self, meta: &log::Metadata) -> bool {
        abi::log_enabled(level(meta.level()))
    }

    fn log(&self, record: &log::Record) {
        let level = level(record.level());
        if abi::log_enabled(level) {
            abi::log(level, &record.args().to_string());
        }
    }

    fn flush(&self) {}
}

fn level(l: log::Level) -> u32 {
    match l {
        log::Level::Error => abi::LOG_ERROR,
        log::Level::Warn => abi::LOG_WARN,
        log::Level::Info => abi::LOG_INFO,
        log::Level::Debug => abi::LOG_DEBUG,
        log::Level::Trace => abi::LOG_TRACE,
    }
}

pub fn install_logger() {
    static LOGGER: EnvoyLogger = EnvoyLogger;
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Info);
}
