//! The pure core's traits implemented over the dynamic-module callbacks and process memory.

use super::abi::{self, Body, ConfigHandle, MainThread, StatKind, StatOp, Stream};
use llm_governor_core::config::Config;
use llm_governor_core::effects::{from_upstream, StreamIo};
use llm_governor_core::metrics::{
    Catalogue, ClassStat, Counter, Family, Gauge, Histogram, Kind, Metrics, Sink, StatWriter,
    Write, CLASS_LABEL, POOL_LABEL,
};
use llm_governor_core::store::MemStore;
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
    label: Label,
}

/// The second label's value of a stat: none, a fixed one, or a hold class's name.
#[derive(Clone, Copy)]
enum Label {
    None,
    Fixed(&'static str),
    Class(usize),
}

/// The core's catalogue over labelled families (`metrics::Family`): one family per stat kind,
/// defined once in `config_new` (the only place the ABI allows it), each pool a label value.
pub struct Stats {
    catalogue: Catalogue<StatId>,
    pools: Vec<String>,
    /// The hold classes with stats (`Hold::stat_classes`), by index.
    classes: Vec<String>,
    /// Whether every counter and gauge was made to exist (see `exist`).
    made: AtomicBool,
}

impl Stats {
    pub fn define(cfg: &ConfigHandle, config: &Config) -> Stats {
        let mut families: HashMap<&'static str, Option<usize>> = HashMap::new();
        let mut family = |kind, name: &'static str, labels: &[&str]| {
            *families.entry(name).or_insert_with(|| {
                let kind = match kind {
                    Kind::Counter => StatKind::Counter,
                    Kind::Gauge => StatKind::Gauge,
                    Kind::Histogram => StatKind::Histogram,
                };
                let id = cfg.define(kind, name, labels);
                if id.is_none() {
                    log::warn!("llm_governor: could not define stat {name}");
                }
                id
            })
        };
        let pools = || config.pools.iter().map(|p| p.name.as_str());
        let classes = config.hold.stat_classes();
        let catalogue = Catalogue::define(pools(), |kind, _pool, stat| {
            let f = Family::of(stat);
            let labels: Vec<&str> = std::iter::once(POOL_LABEL)
                .chain(f.label.map(|(name, _)| name))
                .collect();
            let label = f
                .label
                .map_or(Label::None, |(_, value)| Label::Fixed(value));
            family(kind, f.name, &labels).map(|id| StatId { id, label })
        })
        .define_classes(pools(), &classes, |kind, _pool, class, stat| {
            let index = classes.iter().position(|c| *c == class).unwrap_or(0);
            let labels = [POOL_LABEL, CLASS_LABEL];
            let id = family(kind, stat.family(), &labels)?;
            Some(StatId {
                id,
                label: Label::Class(index),
            })
        });
        Stats {
            catalogue,
            pools: pools().map(str::to_string).collect(),
            classes: classes.iter().map(|c| c.to_string()).collect(),
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
        let mut to = self.to(To::Stream(s));
        for pool in 0..self.pools.len() {
            for c in Counter::ALL {
                if let Some(id) = self.catalogue.counter(pool, c) {
                    to.op(pool, id, StatOp::Increment, 0);
                }
            }
            for g in Gauge::ALL {
                if let Some(id) = self.catalogue.gauge(pool, g) {
                    to.op(pool, id, StatOp::Raise, 0);
                }
            }
            for class in 0..self.classes.len() {
                for stat in ClassStat::ALL {
                    let op = match stat.kind() {
                        Kind::Counter => StatOp::Increment,
                        Kind::Gauge => StatOp::Raise,
                        Kind::Histogram => continue,
                    };
                    if let Some(id) = self.catalogue.class(pool, class, stat) {
                        to.op(pool, id, op, 0);
                    }
                }
            }
        }
    }

    /// The sink for a call on stream `s` (Envoy finds the stats through the stream's filter).
    pub fn on(&self, s: Stream) -> Sink<'_, StatId, StatTo<'_>> {
        Sink {
            catalogue: &self.catalogue,
            writer: self.to(To::Stream(s)),
        }
    }

    /// The sink for a call on the main thread, with no stream at hand (an owed call's answer).
    pub fn on_main<'a>(&'a self, main: &'a MainThread) -> Sink<'a, StatId, StatTo<'a>> {
        Sink {
            catalogue: &self.catalogue,
            writer: self.to(To::Main(main)),
        }
    }

    fn to<'a>(&'a self, to: To<'a>) -> StatTo<'a> {
        StatTo {
            pools: &self.pools,
            classes: &self.classes,
            to,
        }
    }
}

/// Where stats are written: through a stream's filter (its worker thread), or the config (the
/// main thread); each with the pool's name as its label.
pub struct StatTo<'a> {
    pools: &'a [String],
    classes: &'a [String],
    to: To<'a>,
}

enum To<'a> {
    Stream(Stream),
    Main(&'a MainThread),
}

impl StatTo<'_> {
    fn op(&mut self, pool: usize, stat: StatId, op: StatOp, value: u64) {
        let Some(name) = self.pools.get(pool) else {
            return;
        };
        let labels: &[&str] = match stat.label {
            Label::Fixed(label) => &[name, label],
            Label::Class(c) => match self.classes.get(c) {
                Some(class) => &[name, class],
                None => return,
            },
            Label::None => &[name],
        };
        match self.to {
            To::Stream(s) => s.stat(op, stat.id, labels, value),
            To::Main(main) => main.stat(op, stat.id, labels, value),
        }
    }
}

impl StatWriter<StatId> for StatTo<'_> {
    fn write(&mut self, pool: usize, stat: StatId, write: Write) {
        let (op, value) = match write {
            Write::Count => (StatOp::Increment, 1),
            Write::Set(v) => (StatOp::Set, v),
            Write::Move(d) if d < 0 => (StatOp::Lower, d.unsigned_abs()),
            Write::Move(d) => (StatOp::Raise, d.unsigned_abs()),
            Write::Record(v) => (StatOp::Record, v),
        };
        self.op(pool, stat, op, value);
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
        match self.stream(id) {
            Some(s) => s.with_code_details(from_upstream),
            None => from_upstream(None),
        }
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
