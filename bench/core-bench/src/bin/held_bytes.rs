//! `held_bytes <n>`: the pure core's own heap per held request. One `Worker` over the
//! in-memory store: one upstream 429 (`retry-after: 80`) cools the account, then `n` requests
//! of that account arrive and are held; the heap the worker and the store gained is counted by
//! this binary's allocator and divided by `n`. What the core keeps for a held request is the
//! same in both hosts: the wasm module keeps it in the VM's linear memory, the native one in
//! Envoy's process heap. Prints one JSON line.

use llm_governor_core::config;
use llm_governor_core::headers::Headers;
use llm_governor_core::keys::HashKey;
use llm_governor_core::metrics::{Counter, Gauge, Histogram, Metrics};
use llm_governor_core::policy::{Governor, RequestView};
use llm_governor_core::store::MemStore;
use llm_governor_core::worker::{Action, Lent, NoBodies, Stage, Worker};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

/// The system allocator, keeping the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is the system allocator's, with the same layout.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Stats go nowhere (a host's stat writes are its own cost, not the core's).
struct NoStats;
impl Metrics for NoStats {
    fn count(&mut self, _: usize, _: Counter) {}
    fn gauge(&mut self, _: usize, _: Gauge, _: u64) {}
    fn add(&mut self, _: usize, _: Gauge, _: i64) {}
    fn histogram(&mut self, _: usize, _: Histogram, _: u64) {}
}

/// bench/hold_cost.py's configuration and request.
const CONFIG: &str = r#"{"pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}],
  "hold": {"max_ms": 90000, "max_held": 100000}}"#;
const REQUEST: [(&str, &str); 6] = [
    (":authority", "x"),
    (":path", "/v1/chat/completions"),
    (":method", "POST"),
    ("content-type", "application/json"),
    ("authorization", "Bearer sk-hold-cost"),
    ("content-length", "72"),
];

fn main() {
    let n: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    let cfg = config::parse(CONFIG.as_bytes()).unwrap_or_else(|e| {
        eprintln!("held_bytes: {e}");
        std::process::exit(2);
    });
    let gov = Arc::new(Governor::new(cfg, HashKey::from_words(1, 2)));
    let mut worker = Worker::new(gov, 1);
    let store = MemStore::new();
    let now = 1_796_055_600_000u64;
    let clock = || now;
    let mut lent = Lent {
        store: &store,
        metrics: &mut NoStats,
        clock: &clock,
        io: &mut NoBodies,
    };
    let pairs: Vec<(&[u8], &[u8])> = REQUEST
        .iter()
        .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
        .collect();
    let view = RequestView::of(Headers::borrowed(&pairs));
    // The 429 that cools the account (its stream then ends).
    let r = worker.on_request_headers(0, &view, true, &mut lent);
    assert_eq!(
        r.action,
        Action::Continue,
        "the first request goes upstream"
    );
    let resp: Vec<(&[u8], &[u8])> = vec![(b":status", b"429"), (b"retry-after", b"80")];
    worker.on_response_headers(0, &Headers::borrowed(&resp), true, &mut lent);
    worker.on_end(0, &mut lent);
    // Warm: one held request (first-use allocations), released.
    worker.on_request_headers(1, &view, true, &mut lent);
    assert_eq!(
        worker.stage(1),
        Stage::Held,
        "the cooled account's request is held"
    );
    worker.on_end(1, &mut lent);
    let before = LIVE.load(Ordering::Relaxed);
    for id in 2..2 + n {
        worker.on_request_headers(id, &view, true, &mut lent);
    }
    let held = (2..2 + n)
        .filter(|id| worker.stage(*id) == Stage::Held)
        .count();
    let after = LIVE.load(Ordering::Relaxed);
    assert_eq!(held, n as usize, "every request is held");
    println!(
        "{{\"held\": {held}, \"core_bytes\": {}, \"core_bytes_per_held\": {:.1}}}",
        after - before,
        (after - before) as f64 / f64::from(n)
    );
}
