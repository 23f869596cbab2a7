//! `core-bench hotpath <config.json> <iterations>`: the per-request work of the pure core as a
//! host drives it (one `Worker`: request headers and body, response headers and body, the
//! stream's end), against the in-memory store, with header lists rebuilt per request as the
//! host layer does.
//! `core-bench contention <threads> <keys> <updates-per-thread>`: threads doing the filter's
//! bucket CAS update against one mutex-guarded map (Envoy's shared-data semantics); prints CAS
//! retries per update. Both print one JSON line.

use llm_governor_core::config;
use llm_governor_core::headers::{Headers, WireHeaders};
use llm_governor_core::metrics::{Counter, Gauge, Histogram, Metrics};
use llm_governor_core::policy::{Governor, RequestView};
use llm_governor_core::store::{self, MemStore, SharedStore, StoreError};
use llm_governor_core::worker::{Action, Lent, NoBodies, Worker};
use std::cell::Cell;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

/// Counts the metric hostcalls the host makes: every call that reaches the sink (the worker's
/// gauge cache in front of it skips gauge writes that repeat this worker's last value).
#[derive(Default)]
struct CountingMetrics {
    calls: u64,
}
impl Metrics for CountingMetrics {
    fn count(&mut self, _: usize, _: Counter) {
        self.calls += 1;
    }
    fn gauge(&mut self, _: usize, _: Gauge, _: u64) {
        self.calls += 1;
    }
    fn add(&mut self, _: usize, _: Gauge, _: i64) {
        self.calls += 1;
    }
    fn histogram(&mut self, _: usize, _: Histogram, _: u64) {
        self.calls += 1;
    }
}

/// The in-memory store, counting reads and writes (each one shared-data hostcall in Envoy,
/// under its process-wide mutex).
#[derive(Default)]
struct CountingStore {
    inner: MemStore,
    gets: std::cell::Cell<u64>,
    sets: std::cell::Cell<u64>,
}
impl SharedStore for CountingStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.gets.set(self.gets.get() + 1);
        self.inner.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.sets.set(self.sets.get() + 1);
        self.inner.set(key, value, cas)
    }
}

/// Hostcalls of one phase: shared-data reads, writes, metric calls and clock reads, summed
/// over requests.
#[derive(Default, Clone, Copy)]
struct Calls {
    gets: u64,
    sets: u64,
    metrics: u64,
    clock: u64,
}
impl Calls {
    fn now(store: &CountingStore, metrics: &CountingMetrics, clock: &Cell<u64>) -> Calls {
        Calls { gets: store.gets.get(), sets: store.sets.get(), metrics: metrics.calls, clock: clock.get() }
    }
    fn since(self, before: Calls) -> Calls {
        Calls {
            gets: self.gets - before.gets,
            sets: self.sets - before.sets,
            metrics: self.metrics - before.metrics,
            clock: self.clock - before.clock,
        }
    }
    fn add(&mut self, d: Calls) {
        self.gets += d.gets;
        self.sets += d.sets;
        self.metrics += d.metrics;
        self.clock += d.clock;
    }
    fn json(&self, n: u64) -> String {
        let per = |x: u64| x as f64 / n.max(1) as f64;
        format!(
            "{{\"shared_data_get\":{:.2},\"shared_data_set\":{:.2},\"metric\":{:.2},\"clock\":{:.2}}}",
            per(self.gets),
            per(self.sets),
            per(self.metrics),
            per(self.clock)
        )
    }
}


fn hotpath(cfg_json: &str, iterations: u64) {
    let cfg = match config::parse(cfg_json.as_bytes()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("core-bench: {e}");
            std::process::exit(2);
        }
    };
    let mut worker = Worker::new(Arc::new(Governor::new(cfg, llm_governor_core::keys::HashKey::from_words(1, 2))), 1);
    let store = CountingStore::default();
    let mut metrics = CountingMetrics::default();
    let resp = [
        (":status", "200"),
        ("content-type", "application/json"),
        ("openai-processing-ms", "120"),
        ("x-ratelimit-limit-requests", "10000"),
        ("x-ratelimit-remaining-requests", "9999"),
        ("x-ratelimit-reset-requests", "6ms"),
        ("x-ratelimit-limit-tokens", "30000000"),
        ("x-ratelimit-remaining-tokens", "29999982"),
        ("x-ratelimit-reset-tokens", "0s"),
        ("content-length", "360"),
        ("date", "Mon, 30 Nov 2026 16:23:27 GMT"),
        ("server", "envoy"),
        ("x-envoy-upstream-service-time", "0"),
    ];
    let tenants: Vec<String> = (0..1000).map(|i| format!("tenant-{i}")).collect();
    // The host hands each callback one buffer in the proxy-wasm wire format; the host layer
    // reads it in place (WireHeaders): one copy of the buffer and one span list per callback.
    let wire = |pairs: &[(&str, &str)]| {
        WireHeaders::encode(pairs.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    };
    let resp_wire = wire(&resp);
    let req_wires: Vec<Vec<u8>> = tenants
        .iter()
        .map(|t| {
            wire(&[
                (":authority", "127.0.0.1:10000"),
                (":path", "/v1/chat/completions"),
                (":method", "POST"),
                (":scheme", "http"),
                ("user-agent", "wrk"),
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-bench-0123456789"),
                ("x-tenant-id", t),
                ("content-length", "68"),
                ("x-forwarded-proto", "http"),
                ("x-request-id", "0b5c4a39-7f0e-4d0e-9a54-0f6f3a3f2f1e"),
            ])
        })
        .collect();
    let start = Instant::now();
    let mut forwarded = 0u64;
    let (mut req_calls, mut resp_calls) = (Calls::default(), Calls::default());
    // Clock reads: the host reads the clock only when the policy asks for the time (a lazy
    // clock on both paths, counted here).
    let clock = Cell::new(0u64);
    for i in 0..iterations {
        let now_ms = 1_700_000_000_000 + i / 20;
        let read = || {
            clock.set(clock.get() + 1);
            now_ms
        };
        let before = Calls::now(&store, &metrics, &clock);
        let mut lent = Lent { store: &store, metrics: &mut metrics, clock: &read, io: &mut NoBodies };
        let id = i as u32;
        let go = request_path(&mut worker, id, &req_wires[(i % 1000) as usize], &mut lent);
        let middle = Calls::now(&store, &metrics, &clock);
        req_calls.add(middle.since(before));
        let mut lent = Lent { store: &store, metrics: &mut metrics, clock: &read, io: &mut NoBodies };
        if go {
            forwarded += 1;
            response_path(&mut worker, id, &resp_wire, &mut lent);
            resp_calls.add(Calls::now(&store, &metrics, &clock).since(middle));
        } else {
            worker.on_end(id, &mut lent);
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / iterations as f64;
    println!(
        "{{\"iterations\":{iterations},\"forwarded\":{forwarded},\"ns_per_request\":{ns:.0},\"request_path\":{},\"response_path\":{}}}",
        req_calls.json(iterations),
        resp_calls.json(forwarded)
    );
}

/// The request path as the host drives it: the request header map read in place, then the
/// worker's request headers and body callbacks. Not inlined, so callgrind reports it as one
/// function.
#[inline(never)]
fn request_path(worker: &mut Worker, id: u32, wire: &[u8], lent: &mut Lent) -> bool {
    let req = WireHeaders::parse(wire.to_vec()).unwrap_or_default();
    let view = RequestView {
        path: Headers::wire(&req).get(":path").unwrap_or(b""),
        authority: Headers::wire(&req).get(":authority").unwrap_or(b""),
        headers: Headers::wire(&req),
    };
    let r = worker.on_request_headers(id, &view, false, lent);
    r.action == Action::Continue
        && black_box(worker.on_request_body(id, 68, true, lent)).action == Action::Continue
}

/// The response path: response headers read in place, classified and counted, the body, then
/// the stream's end (slots given back, gauges moved).
#[inline(never)]
fn response_path(worker: &mut Worker, id: u32, wire: &[u8], lent: &mut Lent) {
    let pairs = WireHeaders::parse(wire.to_vec()).unwrap_or_default();
    black_box(worker.on_response_headers(id, &Headers::wire(&pairs), false, lent));
    black_box(worker.on_response_body(id, 360, true, lent));
    worker.on_end(id, lent);
}

fn contention(threads: usize, keys: usize, per_thread: u64) {
    let store = MemStore::new();
    let start = Instant::now();
    let (conflicts, giveups): (u64, u64) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let store = &store;
                s.spawn(move || {
                    let (mut c, mut g) = (0u64, 0u64);
                    for i in 0..per_thread {
                        let key =
                            format!("b:tenant-rpm:{:016x}", (i as usize * threads + t) % keys);
                        match store::update(store, &key, Some(&[0u8; 16]), |cur| {
                            let mut v = cur.map(|b| b.to_vec()).unwrap_or_else(|| vec![0; 16]);
                            v[0] = v[0].wrapping_add(1);
                            (Some(v), ())
                        }) {
                            Ok(u) => c += u64::from(u.conflicts),
                            Err(_) => {
                                g += 1;
                                c += u64::from(store::MAX_CAS_ATTEMPTS);
                            }
                        }
                    }
                    (c, g)
                })
            })
            .collect();
        hs.into_iter()
            .filter_map(|h| h.join().ok())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    });
    let total = per_thread * threads as u64;
    println!("{{\"threads\":{threads},\"keys\":{keys},\"updates\":{total},\"retries_per_update\":{:.4},\"giveups_per_update\":{:.6},\"ns_per_update\":{:.0}}}",
             conflicts as f64 / total as f64, giveups as f64 / total as f64,
             start.elapsed().as_nanos() as f64 * threads as f64 / total as f64);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    match args.get(1).map(String::as_str) {
        Some("hotpath") => hotpath(&arg(2, "{}"), arg(3, "200000").parse().unwrap_or(200_000)),
        Some("contention") => contention(
            arg(2, "2").parse().unwrap_or(2),
            arg(3, "1").parse().unwrap_or(1),
            arg(4, "200000").parse().unwrap_or(200_000),
        ),
        _ => {
            eprintln!("usage: core-bench hotpath <config.json> [iterations] | contention <threads> <keys> [updates]");
            std::process::exit(2);
        }
    }
}
